"""The quantization x attention interaction (experiments/configs/quant_ablation.py):
interaction.md when a sweep varies `model.quantization` and one other field.

For each level of the other field (e.g. num_kv_heads 4, 2, 1) and each scheme: Δ =
scheme - none on the final eval loss, paired by seed (stats.compare), with its 95% CI;
and the interaction: that Δ minus the first level's Δ (MHA's), per seed, with its CI.
A CI off zero there says the scheme costs this layout more (or less) than the first.
"""

from __future__ import annotations

import os

from experiments.report import stats as report_stats

TREATMENT = "model.quantization"
METRIC = "final_loss"


def _key(g: dict, other: str):
  return g[TREATMENT], g[other]


def table(groups: list[dict], fields: list[str]) -> str:
  """The markdown table ("" when the sweep is not two factors with TREATMENT)."""
  others = [f for f in fields if f != TREATMENT]
  if TREATMENT not in fields or len(others) != 1:
    return ""
  other = others[0]
  cell = {_key(g, other): report_stats.by_seed(g, METRIC) for g in groups}
  levels = list(dict.fromkeys(g[other] for g in groups))
  treated = [q for q in dict.fromkeys(g[TREATMENT] for g in groups) if q != "none"]
  if not treated or not all(("none", k) in cell for k in levels):
    return ""
  delta = {(q, k): {s: v - cell["none", k][s] for s, v in cell.get((q, k), {}).items()
                    if s in cell["none", k]} for q in treated for k in levels}
  name = other.split(".")[-1]
  lines = [f"| {name} | scheme | n | Δ {METRIC} vs none [95% CI] | "
           f"interaction: Δ - Δ at {name}={levels[0]} [95% CI] |", "|---|---|---|---|---|"]
  for k in levels:
    for q in treated:
      d = delta[q, k]
      zeros = {s: 0.0 for s in d}
      main = report_stats.interval_cell(*report_stats.compare(d, zeros)[0]) if d else ""
      base = delta[q, levels[0]]
      ix = ("(reference)" if k == levels[0] else report_stats.interval_cell(
          *report_stats.compare(d, base)[0]) if d and base else "")
      lines.append(f"| {k} | {q} | {len(d)} | {main} | {ix} |")
  return "\n".join(lines) + (
      "\n\nΔ: the scheme's final eval loss minus the unquantized run's of the same seed "
      "and layout (paired t over seeds). Interaction: that Δ minus the first layout's Δ, "
      "seed by seed (paired where both have the seed, else Welch).\n")


def write(out: str, groups: list[dict], fields: list[str]) -> dict[str, str]:
  text = table(groups, fields)
  if not text:
    return {}
  path = os.path.join(out, "interaction.md")
  with open(path, "w") as f:
    f.write(text)
  return {"interaction": path}

"""Significance in every table: each group's difference to the sweep's baseline.

A group (runs that differ only in their seed) is compared with its baseline: the
first group in sweep order that shares its compute (model size, steps, lr, batch:
`SCALE_FIELDS` among the swept fields), so a ladder compares variants within each
size and budget. The difference of seed means gets a 95% confidence interval and a
two-sided p-value from Welch's t-test (unequal variances, Welch-Satterthwaite
degrees of freedom); n is each side's number of seeds. Fewer than `MIN_SEEDS` seeds on
either side is flagged: the interval exists from 2 seeds but is wide and its
variance estimate poor; with 1 seed there is no interval at all.

Columns added to each group (summary.csv; `load_results(root, groups=True)`):
  baseline                 the baseline group's label ("" for a baseline itself)
  d_<m>, d_<m>_lo, _hi     mean(group) - mean(baseline), and its 95% interval
  p_<m>                    Welch's two-sided p-value
  few_seeds                True when either side has fewer than MIN_SEEDS seeds
"""

from __future__ import annotations

import math
import statistics
from typing import Sequence

MIN_SEEDS = 3
METRICS = ("final_loss", "final_bpb")  # Compared against the baseline.
SCALE_FIELDS = ("model.d_model", "model.num_layers", "model.mlp_dim", "model.num_heads",
                "train.steps", "train.lr", "data.batch_size", "data.seq_len")
FLAG = "†"


def welch(a: Sequence[float], b: Sequence[float], level: float = 0.95
          ) -> tuple[float, float | None, float | None, float | None]:
  """(mean(a) - mean(b), CI low, CI high, two-sided p) by Welch's t-test; the interval
  and p are None when either side has fewer than 2 values. Equal constant samples
  give a zero-width interval (and p = 1 for equal means, 0 otherwise)."""
  from scipy import special  # pylint: disable=g-import-not-at-top  (lighter than scipy.stats)
  diff = statistics.fmean(a) - statistics.fmean(b)
  if len(a) < 2 or len(b) < 2:
    return diff, None, None, None
  va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
  se = math.sqrt(va + vb)
  if se == 0:
    return diff, diff, diff, 1.0 if diff == 0 else 0.0
  df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
  half = special.stdtrit(df, 0.5 + level / 2) * se  # Student's t quantile.
  p = 2 * special.stdtr(df, -abs(diff) / se)
  return diff, diff - half, diff + half, float(p)


def baseline_index(groups: list[dict], fields: list[str]) -> list[int]:
  """For each group, the index of its baseline (itself for a baseline)."""
  scale = [f for f in fields if f in SCALE_FIELDS]
  key = lambda g: tuple(str(g.get(f)) for f in scale)
  first: dict[tuple, int] = {}
  return [first.setdefault(key(g), i) for i, g in enumerate(groups)]


def add_significance(groups: list[dict], fields: list[str]) -> None:
  """Adds the columns above to each group in place; a group carries its seeds' values
  under `_values` ({metric: [values]}, experiments/report.py's group_rows)."""
  for g, b in zip(groups, baseline_index(groups, fields)):
    base = groups[b]
    g["baseline"] = "" if base is g else base["label"]
    g["few_seeds"] = g["n"] < MIN_SEEDS or base["n"] < MIN_SEEDS
    for m in METRICS:
      a, ref = g["_values"].get(m) or [], base["_values"].get(m) or []
      out = welch(a, ref) if a and ref and base is not g else (None, None, None, None)
      g[f"d_{m}"], g[f"d_{m}_lo"], g[f"d_{m}_hi"], g[f"p_{m}"] = out


COLUMNS = ("baseline", *(f"{p}{m}{s}" for m in METRICS
                         for p, s in (("d_", ""), ("d_", "_lo"), ("d_", "_hi"), ("p_", ""))),
           "few_seeds")


def delta_cell(g: dict, m: str = "final_loss") -> str:
  """"+0.0040 [-0.0100, +0.0180] p=0.42", "baseline", or the difference alone (1 seed)."""
  if not g.get("baseline"):
    return "baseline"
  d, lo, hi, p = (g.get(f"{k}_{m}{s}") for k, s in (("d", ""), ("d", "_lo"), ("d", "_hi"),
                                                      ("p", "")))
  if d is None:
    return ""
  if lo is None:
    return f"{d:+.4f} (no CI: 1 seed)"
  return f"{d:+.4f} [{lo:+.4f}, {hi:+.4f}] p={p:.2g}"


def n_cell(g: dict) -> str:
  return f"{g['n']}{FLAG}" if g.get("few_seeds") else str(g["n"])


def note(groups: list[dict], m: str = "final_loss") -> str:
  """The legend under a table (plain text), "" when there is no comparison."""
  if not any(g.get("baseline") for g in groups):
    return ""
  text = (f"Δ {m}: mean difference to the baseline row (the first row at the same model "
          "size, steps, lr and batch), 95% CI and p by Welch's t-test over seeds.")
  if any(g.get("few_seeds") for g in groups):
    text += f" {FLAG} fewer than {MIN_SEEDS} seeds on this row or its baseline: weak evidence."
  return text


def legend(groups: list[dict], template: str) -> str:
  """note() in `template` ("\n{}\n" for markdown, "% {}\n" for LaTeX), or ""."""
  text = note(groups)
  return template.format(text) if text else ""

"""Significance in every table: each group's difference to the sweep's baseline.

A group (runs that differ only in their seed) is compared with its baseline: the
first group in sweep order that shares its compute (model size, steps, lr, batch:
`SCALE_FIELDS` among the swept fields), so a ladder compares variants within each
size and budget. Every model metric is compared (`compared`: losses, bits per byte
per domain, accuracies, task figures; not the budget, machine or exact-size figures),
each over the seeds that measured it (a task scored on one seed has n = 1 there).

The test: when both sides measured the metric on the same seeds (2 or more), the
paired t-test on the per-seed differences -- a seed fixes the data order and the
initialisation of every weight the two variants share, so its own noise cancels
(common random numbers); otherwise Welch's t-test (unequal variances,
Welch-Satterthwaite degrees of freedom). Both give the difference of the means with a
95% confidence interval and a two-sided p-value. Fewer than `MIN_SEEDS` seeds on
either side is flagged: the interval exists from 2 seeds but is wide and its variance
estimate poor; with 1 seed there is no interval at all.

The domain interaction (does a variant's difference differ between domains?): for
each pair of `bpb/<domain>` columns A, B, each run's A - B, compared between the group
and its baseline the same way: (Δ on A) - (Δ on B) with its 95% CI over seeds.

Columns added to each group (summary.csv; `load_results(root, groups=True)`):
  baseline                 the baseline group's label ("" for a baseline itself)
  few_seeds                True when either side has fewer than MIN_SEEDS seeds
  d_<m>, d_<m>_lo, _hi     mean(group) - mean(baseline), and its 95% interval
  p_<m>, test_<m>          the two-sided p-value; "paired" or "welch"
  ix_<A>_vs_<B>, _lo, _hi, p_ix_<A>_vs_<B>   the interaction of domains A and B
"""

from __future__ import annotations

import itertools
import math
import statistics
from typing import Sequence

MIN_SEEDS = 3
# Not compared with the baseline: what a run spent or ran on, and exact model sizes.
NOT_COMPARED = ("tokens", "flops", "tokens_per_s", "mfu", "params", "active_params",
                "kv_bytes_per_token")
SCALE_FIELDS = ("model.d_model", "model.num_layers", "model.mlp_dim", "model.num_heads",
                "train.steps", "train.lr", "data.batch_size", "data.seq_len")
DOMAIN_PREFIX = "bpb/"
FLAG = "†"
_NONE = (None, None, None, None)


def compared(metric: str) -> bool:
  return metric not in NOT_COMPARED


def _t(df: float, level: float) -> float:
  from scipy import special  # pylint: disable=g-import-not-at-top  (lighter than scipy.stats)
  return float(special.stdtrit(df, 0.5 + level / 2))  # Student's t quantile.


def _p(df: float, t: float) -> float:
  from scipy import special  # pylint: disable=g-import-not-at-top
  return float(2 * special.stdtr(df, -abs(t)))


def welch(a: Sequence[float], b: Sequence[float], level: float = 0.95
          ) -> tuple[float, float | None, float | None, float | None]:
  """(mean(a) - mean(b), CI low, CI high, two-sided p) by Welch's t-test; the interval
  and p are None when either side has fewer than 2 values. Equal constant samples
  give a zero-width interval (and p = 1 for equal means, 0 otherwise)."""
  diff = statistics.fmean(a) - statistics.fmean(b)
  if len(a) < 2 or len(b) < 2:
    return diff, None, None, None
  va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
  se = math.sqrt(va + vb)
  if se == 0:
    return diff, diff, diff, 1.0 if diff == 0 else 0.0
  df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
  half = _t(df, level) * se
  return diff, diff - half, diff + half, _p(df, diff / se)


def paired(a: Sequence[float], b: Sequence[float], level: float = 0.95
           ) -> tuple[float, float | None, float | None, float | None]:
  """The paired t-test of a[i] against b[i] (the same seed): (mean difference, CI low,
  CI high, two-sided p); no interval with fewer than 2 pairs."""
  d = [x - y for x, y in zip(a, b, strict=True)]
  diff = statistics.fmean(d)
  if len(d) < 2:
    return diff, None, None, None
  se = statistics.stdev(d) / math.sqrt(len(d))
  if se == 0:
    return diff, diff, diff, 1.0 if diff == 0 else 0.0
  half = _t(len(d) - 1, level) * se
  return diff, diff - half, diff + half, _p(len(d) - 1, diff / se)


def compare(a: dict, b: dict) -> tuple[tuple, str]:
  """({seed: value} against {seed: value}) -> ((d, lo, hi, p), "paired" | "welch")."""
  if len(a) >= 2 and set(a) == set(b):
    seeds = sorted(a, key=str)
    return paired([a[s] for s in seeds], [b[s] for s in seeds]), "paired"
  return welch(list(a.values()), list(b.values())), "welch"


def baseline_index(groups: list[dict], fields: list[str]) -> list[int]:
  """For each group, the index of its baseline (itself for a baseline)."""
  scale = [f for f in fields if f in SCALE_FIELDS]
  key = lambda g: tuple(str(g.get(f)) for f in scale)
  first: dict[tuple, int] = {}
  return [first.setdefault(key(g), i) for i, g in enumerate(groups)]


def by_seed(g: dict, metric: str) -> dict:
  """{seed: value} of the group's runs that measured `metric` (group_rows' `_obs`; a
  group built by hand has only `_values`: its positions stand in for seeds)."""
  obs = g.get("_obs", {}).get(metric)
  if obs is None:
    return dict(enumerate(g.get("_values", {}).get(metric) or []))
  return dict(obs)


def domains(metrics: Sequence[str]) -> list[str]:
  return sorted(m for m in metrics if m.startswith(DOMAIN_PREFIX))


def interaction_key(a: str, b: str) -> str:
  return f"ix_{a[len(DOMAIN_PREFIX):]}_vs_{b[len(DOMAIN_PREFIX):]}"


def _difference(g: dict, a: str, b: str) -> dict:
  """{seed: A - B} over the group's runs that measured both domains."""
  x, y = by_seed(g, a), by_seed(g, b)
  return {s: x[s] - y[s] for s in x if s in y}


def add_significance(groups: list[dict], fields: list[str],
                     metrics: Sequence[str] | None = None) -> None:
  """Adds the columns above to each group in place, for `metrics` (default: every
  compared metric the groups measured)."""
  if metrics is None:
    metrics = list(dict.fromkeys(m for g in groups for m in g.get("_values", {})))
  metrics = [m for m in metrics if compared(m)]
  for g, b in zip(groups, baseline_index(groups, fields)):
    base = groups[b]
    g["baseline"] = "" if base is g else base["label"]
    g["few_seeds"] = g["n"] < MIN_SEEDS or base["n"] < MIN_SEEDS
    for m in metrics:
      a, ref = by_seed(g, m), by_seed(base, m)
      out, test = compare(a, ref) if a and ref and base is not g else (_NONE, "")
      g[f"d_{m}"], g[f"d_{m}_lo"], g[f"d_{m}_hi"], g[f"p_{m}"] = out
      g[f"test_{m}"] = test
    for x, y in itertools.combinations(domains(metrics), 2):
      k = interaction_key(x, y)
      a, ref = _difference(g, x, y), _difference(base, x, y)
      out, _ = compare(a, ref) if a and ref and base is not g else (_NONE, "")
      g[k], g[f"{k}_lo"], g[f"{k}_hi"], g[f"p_{k}"] = out


def columns(metrics: Sequence[str]) -> list[str]:
  """summary.csv's significance columns for `metrics`."""
  out = ["baseline", "few_seeds"]
  for m in (m for m in metrics if compared(m)):
    out += [f"d_{m}", f"d_{m}_lo", f"d_{m}_hi", f"p_{m}", f"test_{m}"]
  for x, y in itertools.combinations(domains([m for m in metrics if compared(m)]), 2):
    k = interaction_key(x, y)
    out += [k, f"{k}_lo", f"{k}_hi", f"p_{k}"]
  return out


def interval_cell(d, lo, hi, p) -> str:
  """"+0.0040 [-0.0100, +0.0180] p=0.42", or the difference alone (no interval)."""
  if d is None:
    return ""
  if lo is None:
    return f"{d:+.4f} (no CI: n=1)"
  return f"{d:+.4f} [{lo:+.4f}, {hi:+.4f}] p={p:.2g}"


def delta_cell(g: dict, m: str = "final_loss") -> str:
  """The Δ cell of metric `m`: its interval_cell, or "baseline"."""
  if not g.get("baseline"):
    return "baseline"
  return interval_cell(*(g.get(f"{k}_{m}{s}") for k, s in (("d", ""), ("d", "_lo"),
                                                             ("d", "_hi"), ("p", ""))))


def n_cell(g: dict) -> str:
  return f"{g['n']}{FLAG}" if g.get("few_seeds") else str(g["n"])


def note(groups: list[dict]) -> str:
  """The legend under a table (plain text), "" when there is no comparison."""
  if not any(g.get("baseline") for g in groups):
    return ""
  text = ("Δ: mean difference to the baseline row (the first row at the same model size, "
          "steps, lr and batch), 95% CI and p over seeds: paired by seed where both rows "
          "measured the metric on the same seeds, else Welch's t-test. n: the row's "
          "seeds; a cell measured on fewer says (n=k).")
  if any(g.get("few_seeds") for g in groups):
    text += f" {FLAG} fewer than {MIN_SEEDS} seeds on this row or its baseline: weak evidence."
  return text


def legend(groups: list[dict], template: str) -> str:
  """note() in `template` ("\n{}\n" for markdown, "% {}\n" for LaTeX), or ""."""
  text = note(groups)
  return template.format(text) if text else ""

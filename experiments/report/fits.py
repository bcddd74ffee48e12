"""Loss against compute per variant: fitted laws, compute multipliers, intervals.

A variant is what the swept fields say beyond compute (model size, steps, lr, batch:
report_stats.SCALE_FIELDS; cadences and warmup are no variant either), e.g.
`num_kv_heads=2`. Its points are its groups (runs differing only in seed, at the
best lr of an lr grid: lr.py) with their training FLOPs C (the report's
`flops`) and seed-mean final loss L. The law

    L(C) = E + A * (C / C0)^-alpha        (C0: the geometric mean of the points' C)

is fitted (scipy's bounded least squares) to the variant's compute frontier: the
points that no point of less compute beats (the lower envelope over model sizes
and budgets, Chinchilla's approach 1 in spirit). At least 3 frontier points are
needed, and a ladder (`is_ladder`): runs at several token budgets (train.steps
swept). A sweep at one budget (the µP transfer sweep: widths x learning rates) has no
frontier to fit: no law, no multiplier. A variant whose law never reaches the
baseline's loss (its E above it) is said so, never as an infinite multiplier.

The compute multiplier of a variant against the baseline (the first variant) at
the largest compute the baseline measured, C*, is the compute the variant's law
needs to reach the baseline's fitted loss L_b(C*), over C*: 1.04x means it needs 4%
more compute. A multiplier whose compute lies outside the
variant's measured range is an extrapolation and says so.

Intervals (95%, percentile) come from `BOOTSTRAP` replicates that resample each
point's seeds (runs) with replacement, and, where the frontier has at least 5
points, the frontier points too; both laws are refitted per replicate. With one
seed per point and a short frontier the interval is degenerate (reported as such).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import random

import numpy as np

from experiments.report import stats as report_stats
from model import ModelConfig
from model.flops import training_flops_per_token
from train.lifecycle.changes import is_operational

BOOTSTRAP = 200
NOT_VARIANT = ("train.warmup_steps", "train.seed")


@functools.lru_cache(maxsize=None)
def _flops_per_token(model_json: str, seq_len: int) -> float | None:
  try:
    return training_flops_per_token(ModelConfig.from_dict(json.loads(model_json)), seq_len)
  except (TypeError, ValueError):
    return None


def training_flops(model_json: str, seq_len: int, tokens: int) -> float | None:
  """A run's compute C: its training tokens x model/flops.py's training FLOPs per token
  (the one formula behind MFU; the trainer logs the same as `train_flops`)."""
  per_token = _flops_per_token(model_json, seq_len)
  return None if per_token is None else float(tokens * per_token)


def is_ladder(fields: list[str]) -> bool:
  """A compute ladder sweeps the token budget (with or without the model size)."""
  return "train.steps" in fields


def variant_fields(fields: list[str]) -> list[str]:
  return [f for f in fields if f not in report_stats.SCALE_FIELDS and f not in NOT_VARIANT
          and not is_operational(f)]


@dataclasses.dataclass
class Law:
  E: float
  A: float
  alpha: float
  C0: float

  def __call__(self, C):
    return self.E + self.A * (np.asarray(C, float) / self.C0) ** -self.alpha

  def compute_for(self, loss: float) -> float:
    """The compute at which the law reaches `loss` (inf if it never does)."""
    if loss <= self.E:
      return math.inf
    return self.C0 * (self.A / (loss - self.E)) ** (1.0 / self.alpha)


def fit_law(C, L) -> Law | None:
  """L = E + A (C/C0)^-alpha by bounded least squares; None with fewer than 3 distinct C."""
  from scipy.optimize import curve_fit  # pylint: disable=g-import-not-at-top
  C, L = np.asarray(C, float), np.asarray(L, float)
  if len(np.unique(C)) < 3:
    return None
  C0 = float(np.exp(np.mean(np.log(C))))
  f = lambda c, E, A, alpha: E + A * (c / C0) ** -alpha
  lo = float(L.min())
  best = None
  for E0 in (0.5 * lo, 0.95 * lo):  # Two starts: the problem is not convex.
    try:
      p, _ = curve_fit(f, C, L, p0=(E0, max(float(L.mean()) - E0, 1e-3), 0.3),
                       bounds=([0.0, 0.0, 1e-3], [lo, np.inf, 3.0]), maxfev=20000)
    except (RuntimeError, ValueError):
      continue
    err = float(np.sum((f(C, *p) - L) ** 2))
    if best is None or err < best[0]:
      best = (err, p)
  return None if best is None else Law(*map(float, best[1]), C0)


def frontier(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
  """(C, L) points that no point of less (or equal) compute beats, by compute."""
  out, best = [], math.inf
  for c, l in sorted(points):
    if l < best:
      out.append((c, l))
      best = l
  return out


def variant_points(groups: list[dict], fields: list[str]) -> dict[str, list[dict]]:
  """{variant label: [group with flops and final_loss values]}, in sweep order."""
  vf = variant_fields(fields)
  out: dict[str, list[dict]] = {}
  for g in groups:
    if not g["_values"].get("flops") or not g["_values"].get("final_loss"):
      continue
    label = ", ".join(f"{f.split('.')[-1]}={g[f]}" for f in vf) or "all"
    out.setdefault(label, []).append(g)
  return out


def _means(members: list[dict], rng: random.Random | None):
  pts = []
  for g in members:
    losses, flops = g["_values"]["final_loss"], g["_values"]["flops"]
    if rng is not None:
      losses = [rng.choice(losses) for _ in losses]
    pts.append((float(np.mean(flops)), float(np.mean(losses))))
  return pts


def _fit(members, rng=None) -> tuple[Law | None, list[tuple[float, float]]]:
  front = frontier(_means(members, rng))
  if rng is not None and len(front) >= 5:
    front = [rng.choice(front) for _ in front]
  return fit_law(*zip(*front)) if len(front) >= 3 else None, front


def _interval(values: list[float]) -> tuple[float | None, float | None]:
  finite = [v for v in values if v is not None and math.isfinite(v)]
  if len(finite) < 0.5 * len(values) or not finite:
    return None, None
  return float(np.percentile(finite, 2.5)), float(np.percentile(finite, 97.5))


def fit_all(groups: list[dict], fields: list[str], seed: int = 0,
            replicates: int = BOOTSTRAP) -> list[dict]:
  """One record per variant: its law, the parameters' and the multiplier's intervals
  (over `replicates` bootstrap replicates)."""
  by_variant = variant_points(groups, fields)
  if not by_variant:
    return []
  fits = {v: _fit(m) for v, m in by_variant.items()}
  base_name = next(iter(by_variant))
  base_law, base_front = fits[base_name]
  c_star = max(c for c, _ in base_front) if base_front else None
  rng = random.Random(seed)
  reps = {v: [] for v in by_variant}
  for _ in range(replicates):
    for v, members in by_variant.items():
      reps[v].append(_fit(members, rng)[0])
  out = []
  for v, (law, front) in fits.items():
    rec = {"variant": v, "points": len(front), "law": law,
           "c_min": min((c for c, _ in front), default=None),
           "c_max": max((c for c, _ in front), default=None), "front": front,
           "all_points": _means(by_variant[v], None), "baseline": v == base_name}
    for name in ("E", "A", "alpha"):
      rec[name] = getattr(law, name) if law else None
      rec[f"{name}_lo"], rec[f"{name}_hi"] = _interval(
          [getattr(r, name) if r else None for r in reps[v]])
    rec["multiplier"] = rec["multiplier_lo"] = rec["multiplier_hi"] = None
    if law and base_law and c_star:
      target = float(base_law(c_star))
      rec["target_loss"], rec["c_star"] = target, c_star
      need = law.compute_for(target)
      rec["multiplier"] = need / c_star
      rec["extrapolated"] = not (rec["c_min"] <= need <= rec["c_max"])
      mult = [r.compute_for(float(b(c_star))) / c_star if r and b else None
              for r, b in zip(reps[v], reps[base_name])]
      rec["multiplier_lo"], rec["multiplier_hi"] = _interval(mult)
    out.append(rec)
  return out


def _num(v, fmt=".3g") -> str:
  return "" if v is None else format(v, fmt)


def _rows(fits: list[dict]) -> tuple[list[str], list[list[str]]]:
  header = ["variant", "points", "E", "A", "alpha", "compute multiplier [95% CI]"]
  body = []
  for r in fits:
    ci = lambda k: (f"{_num(r[k])} [{_num(r[k + '_lo'])}, {_num(r[k + '_hi'])}]"
                    if r[k] is not None else "")
    if r["law"] is None:
      mult = f"no fit (needs 3 frontier points, has {r['points']})"
    elif r["baseline"]:
      mult = "1 (baseline)"
    elif r["multiplier"] is None:
      mult = ""
    elif not math.isfinite(r["multiplier"]):
      mult = "never reaches the baseline's loss (E above it)"
    else:
      mult = (f"{r['multiplier']:.3g}x [{_num(r['multiplier_lo'])}, {_num(r['multiplier_hi'])}]"
              + (" (extrapolated)" if r["extrapolated"] else ""))
    body.append([r["variant"], str(r["points"]), ci("E"), ci("A"), ci("alpha"), mult])
  return header, body


def describe(fits: list[dict]) -> str:
  """The legend and one sentence per variant (markdown, printed output)."""
  base = next((r for r in fits if r["baseline"]), None)
  lines = []
  if base and base.get("law"):
    lines.append(f"L(C) = E + A (C/C0)^-alpha fitted to each variant's compute frontier; "
                 f"multipliers at the baseline's largest measured compute C* = "
                 f"{base['c_max']:.3g} FLOPs (loss {float(base['law'](base['c_max'])):.4f}); "
                 f"95% intervals over {BOOTSTRAP} bootstrap replicates of seeds (and "
                 "frontier points where there are >= 5).")
  for r in fits:
    if r["baseline"] or r["multiplier"] is None:
      continue
    if not math.isfinite(r["multiplier"]):
      lines.append(f"{r['variant']} never reaches {base['variant']}'s loss on its fitted law "
                   f"(its E = {r['E']:.4f} is above the target {r['target_loss']:.4f}).")
      continue
    where = " (extrapolated beyond its measured compute)" if r["extrapolated"] else ""
    lines.append(f"{r['variant']} reaches {base['variant']}'s loss with "
                 f"{r['multiplier']:.3g}x [{_num(r['multiplier_lo'])}, "
                 f"{_num(r['multiplier_hi'])}] of its compute{where}.")
  return "\n".join(lines)


def markdown(fits: list[dict]) -> str:
  header, body = _rows(fits)
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(r) + " |" for r in body]
  return "\n".join(lines) + "\n\n" + describe(fits) + "\n"


def latex(fits: list[dict], tex) -> str:
  header, body = _rows(fits)
  lines = ["\\begin{tabular}{l" + "r" * (len(header) - 1) + "}", "\\toprule",
           " & ".join(tex(h) for h in header) + " \\\\", "\\midrule"]
  lines += [" & ".join(tex(c) for c in r) + " \\\\" for r in body]
  comment = "".join(f"% {l}\n" for l in describe(fits).splitlines())
  return "\n".join(lines + ["\\bottomrule", "\\end{tabular}"]) + "\n" + comment


def records(fits: list[dict]) -> list[dict]:
  """fits.json: the numbers, without the law objects."""
  keep = lambda r: {k: v for k, v in r.items() if k != "law"}
  return json.loads(json.dumps([keep(r) for r in fits], default=float))

"""Learning-rate sensitivity (Wortsman et al. 2023, "Small-scale proxies for large-scale
Transformer training instabilities", section 3.1): for one variant's lr grid,

    sensitivity = E over the grid's lrs of min(loss(lr), loss at init) - min over lrs of loss

per seed (each run's final eval loss; a run that diverged counts as its loss at init),
then the mean and std over the seeds that ran every lr of the grid (n of them; one
seed: its value, no std). Small is robust: the loss is near its best over the grid.
The loss at init is the run's eval at step 0 (`eval.at_start=True`, which
experiments/configs/stability.py and mup_transfer.py set); a run without it falls back
to ln(vocab size), the loss of a uniform prediction, and the table says so.

A run diverged when its loss became non-finite: the point FAILED with the loop's
non-finite error (train.on_nonfinite="stop"), or it finished with a non-finite final
loss. An unfinished or otherwise failed run is missing, not diverged: its seed has no
sensitivity until it is re-run.

Also `lr_loss.png` / `.pdf`: final loss against lr (log axis) per variant, the mean over
seeds with their std as error bars and each seed as a dot; diverged runs are crosses at
their loss at init.
"""

from __future__ import annotations

import math
import os
import re
import statistics

from experiments.report import stats as report_stats, style as report_style

LR = "train.lr"
_SEED_SUFFIX = re.compile(r"[-_]s(eed)?\d+$")


def diverged(row: dict) -> bool:
  return "non-finite" in (row.get("excluded") or "")


def outcome(row: dict) -> tuple[str, float | None, float | None, bool]:
  """(kind, final loss, loss at init, whether that is ln V) of a run; kind "loss",
  "diverged" (no loss) or "missing" (no loss)."""
  init, fallback = row.get("_init_loss"), False
  if init is None and row.get("_vocab_size"):
    init, fallback = math.log(row["_vocab_size"]), True
  if row.get("status") == "finished" and not row.get("excluded"):
    return "loss", row.get("final_loss"), init, fallback
  return ("diverged" if diverged(row) else "missing"), None, init, fallback


def seed_name(row: dict) -> str:
  return _SEED_SUFFIX.sub("", os.path.basename(row["run"]))


def grid_points(rows: list[dict], key_of) -> dict[str, dict]:
  """{grid key: {(lr, seed): outcome}} of every row with an lr; `key_of(row)` its grid."""
  grids: dict[str, dict] = {}
  for r in rows:
    if r.get(LR) is not None:
      grids.setdefault(key_of(r), {})[(r[LR], r.get("seed"))] = outcome(r)
  return grids


def sensitivity(points: dict) -> dict:
  """{"mean", "std", "n", "per_seed", "diverged", "missing", "init_fallback"} of a grid."""
  lrs = sorted({lr for lr, _ in points})
  seeds = sorted({s for _, s in points}, key=str)
  per_seed, fallback = {}, False
  for s in seeds:
    here = [points.get((lr, s)) for lr in lrs]
    if any(o is None or o[0] == "missing" or o[2] is None for o in here):
      continue  # Not run (or without any loss at init) at some lr: no value for this seed.
    fallback |= any(o[3] for o in here)
    capped = [min(o[1], o[2]) if o[0] == "loss" else o[2] for o in here]
    per_seed[s] = statistics.fmean(capped) - min(capped)
  values = list(per_seed.values())
  return {"mean": statistics.fmean(values) if values else None,
          "std": statistics.stdev(values) if len(values) > 1 else None, "n": len(values),
          "per_seed": per_seed, "lrs": lrs,
          "diverged": sum(o[0] == "diverged" for o in points.values()),
          "missing": sum(o[0] == "missing" for o in points.values()),
          "runs": len(points), "init_fallback": fallback}


def cell(sens: dict) -> str:
  """"0.1234 ± 0.0100 (n=2)"; one seed: "0.1234 (n=1)"; none: "—"."""
  if sens["mean"] is None:
    return "—"
  std = f" ± {sens['std']:.4f}" if sens["std"] is not None else ""
  return f"{sens['mean']:.4f}{std} (n={sens['n']})"


def add_delta(g: dict, base: dict) -> None:
  """`d_sensitivity` (d, lo, hi, p) and `test_sensitivity` on best-lr group `g`: its lr
  sensitivity minus its baseline row's (`base`; None for a baseline itself or without a
  sensitivity on either side), over seeds as every table's Δ (stats.py): paired by seed
  where both grids have the same seeds (2 or more), else Welch's t-test. The question
  "which optimizer (variant) is least sensitive" then has an interval, not two means."""
  a, b = (x.get("sensitivity", {}).get("per_seed") for x in (g, base))
  if g is base or not a or not b:
    g["d_sensitivity"], g["test_sensitivity"] = None, ""
    return
  g["d_sensitivity"], g["test_sensitivity"] = report_stats.compare(a, b)


def delta_cell(g: dict) -> str:
  """"+0.0123 [-0.0040, +0.0286] p=0.1" against the baseline row, "baseline", or "—"."""
  if not g.get("baseline"):
    return "baseline"
  d = g.get("d_sensitivity")
  return report_stats.interval_cell(*d) if d else "—"


def diverged_cell(sens: dict) -> str:
  return f"{sens['diverged']}/{sens['runs']}"


def note(best: list[dict]) -> str:
  parts = ["lr sensitivity: E over the grid of min(final loss, loss at init) minus the "
           "best final loss (Wortsman et al. 2023), per seed, mean ± std over the n seeds "
           "that ran every lr; diverged: runs whose loss became non-finite (counted at "
           "their loss at init), of all runs of the grid. Δ lr sensitivity: minus the "
           "baseline row's, 95% CI and p over seeds (paired by seed where both ran the same "
           "seeds); compare rows over grids of the same span (the optimizer recipe's grids "
           "are the same factors of each optimizer's centre lr)."]
  missing = [g["label"] for g in best if g.get("sensitivity", {}).get("missing")]
  if missing:
    parts.append(f"Unfinished or failed runs leave their seed out: {', '.join(missing)}.")
  if any(g.get("sensitivity", {}).get("init_fallback") for g in best):
    parts.append("Some runs have no eval at step 0 (eval.at_start): their loss at init is "
                 "ln(vocab size).")
  return " ".join(parts)


def plot(plt, best: list[dict], path: str) -> None:
  """lr_loss.png: final loss vs lr per variant (see the module docstring)."""
  fig, ax = report_style.figure(plt)
  for i, g in enumerate(best):
    colour, points = f"C{i % 10}", g["lr_points"]
    lrs = g["sensitivity"]["lrs"]
    means, stds, xs = [], [], []
    for lr in lrs:
      losses = [o[1] for (l, _), o in points.items() if l == lr and o[0] == "loss"]
      if losses:
        xs.append(lr)
        means.append(statistics.fmean(losses))
        stds.append(statistics.stdev(losses) if len(losses) > 1 else 0.0)
        ax.plot([lr] * len(losses), losses, ".", color=colour, alpha=0.35, ms=3)
    ax.errorbar(xs, means, yerr=stds, color=colour, marker="o", ms=3, capsize=2,
                label=g["label"])
    bad = [(lr, o[2]) for (lr, _), o in points.items() if o[0] == "diverged" and o[2]]
    if bad:
      ax.plot(*zip(*bad), "x", color=colour, ms=5)
  if any(o[0] == "diverged" for g in best for o in g["lr_points"].values()):
    ax.plot([], [], "x", color="0.4", label="diverged (at loss at init)")
  ax.set_xscale("log")
  ax.set(xlabel="learning rate", ylabel=f"final {report_style.METRIC_NAMES['loss']}")
  ax.grid(alpha=0.3, which="both")
  report_style.legend(ax)
  report_style.save(plt, fig, path)


def init_loss(evals: list[dict]) -> float | None:
  """A run's loss at init: its finite step-0 eval loss (eval.at_start), else None."""
  for r in evals:
    loss = r.get("loss")
    if r.get("step") == 0 and isinstance(loss, (int, float)) and math.isfinite(loss):
      return float(loss)
  return None

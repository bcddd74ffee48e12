"""The report's lr sensitivity (Wortsman et al. 2023): on runs with known losses, a
diverged point counted at its loss at init, seeds' spread, and on a smoke sweep
through launch.py --sweep and `python -m experiments.report`."""

import json
import math
import statistics

import pytest

from experiments import report
from experiments.report import sensitivity as report_sensitivity, stats as report_stats
from tests.cli import launch
from tests.experiments.test_report import _write_run
from tests.experiments.test_report_fits import _lr_run

INIT = 5.5  # Every run's eval at step 0.


def _with_init(root, name, init=INIT):
  path = root / name / "metrics.jsonl"
  path.write_text(json.dumps({"step": 0, "split": "eval", "loss": init}) + "\n" +
                  path.read_text())


def _diverged(root, kv, lr, seed):
  name = _lr_run(root, kv, lr, seed, 2.0)
  _with_init(root, name)
  (root / name / "FAILED").write_text(
      "Traceback (most recent call last):\ntrain.loop.NonFiniteError: non-finite loss or "
      "gradient at step 7: the update was skipped and training stopped")
  return name


def test_sensitivity_counts_a_diverged_run_at_its_init_loss_per_seed(tmp_path):
  # kv4 trains at every lr; kv2 diverges at 1e-1 (seed 0 only) and is worse at 3e-2.
  losses = {(4, 1e-3): 2.4, (4, 1e-2): 2.1, (4, 1e-1): 2.3,
            (2, 1e-3): 2.5, (2, 1e-2): 2.2, (2, 1e-1): 6.0}  # 6.0 > INIT: capped at INIT.
  names = []
  for (kv, lr), loss in losses.items():
    for s in range(2):
      if (kv, lr, s) == (2, 1e-1, 0):
        names.append(_diverged(tmp_path, kv, lr, s))
        continue
      names.append(_lr_run(tmp_path, kv, lr, s, loss + 0.01 * s))
      _with_init(tmp_path, names[-1])
  (tmp_path / "sweep.json").write_text(json.dumps({"points": [{"name": n} for n in names]}))
  paths = report.write_report(str(tmp_path))
  md = open(paths["lr_markdown"]).read()
  want4 = statistics.fmean([2.4, 2.1, 2.3]) - 2.1  # The same for both seeds (+0.01 each).
  # Seed 0 diverged at 0.1, seed 1 reached 6.01 there: both count as INIT.
  per_seed = [statistics.fmean([2.5 + d, 2.2 + d, INIT]) - (2.2 + d) for d in (0.0, 0.01)]
  want2 = f"{statistics.fmean(per_seed):.4f} ± {statistics.stdev(per_seed):.4f}"
  assert "| kv4 | 0.01 | 0.001 0.01 0.1 |" in md
  assert f"| {want4:.4f} ± 0.0000 (n=2) | baseline | 0/6 |" in md
  # kv2's grid still lists 0.1, where only a diverged and a capped run are.
  assert "| kv2 | 0.01 | 0.001 0.01 0.1 |" in md
  # Δ to kv4's, paired by seed: 2 seeds give a (wide) interval.
  d, lo, hi, p = report_stats.paired(per_seed, [want4, want4])
  assert f"| {want2} (n=2) | {report_stats.interval_cell(d, lo, hi, p)} | 1/6 |" in md, md
  assert "Wortsman" in md and "ln(vocab size)" not in md
  assert paths["lr_plot"].endswith("lr_loss.png")


def test_one_seed_has_no_spread_and_a_missing_run_leaves_its_seed_out():
  points = {(1e-3, 0): ("loss", 2.4, INIT, False), (1e-2, 0): ("loss", 2.0, INIT, False),
            (1e-3, 1): ("loss", 2.5, INIT, False), (1e-2, 1): ("missing", None, INIT, False)}
  sens = report_sensitivity.sensitivity(points)
  assert sens["n"] == 1 and sens["std"] is None and sens["missing"] == 1
  assert sens["mean"] == pytest.approx(0.2)
  assert report_sensitivity.cell(sens) == "0.2000 (n=1)"
  assert report_sensitivity.outcome({"status": "finished", "final_loss": 2.0,
                                     "_vocab_size": 256})[2:] == (math.log(256), True)


def test_smoke_sweep_lr_sensitivity(tmp_path):
  root = tmp_path / "stab"
  launch("--config", "experiments/configs/stability.py:smoke,lrs=1e-3+1e-2,variants=base,"
         "seeds=2", "--workdir", str(root), "--sweep")
  paths = report.write_report(str(root))
  md = open(paths["lr_markdown"]).read()
  row = next(l for l in md.splitlines() if l.startswith("| base |"))
  assert "0.001 0.01" in row and row.endswith("(n=2) | baseline | 0/4 |"), row
  # The loss at init is each run's step-0 eval (eval.at_start), not the ln V fallback.
  assert "ln(vocab size)" not in md
  rows = report.collect(str(root))[1]
  assert all(r["_init_loss"] is not None for r in rows)


def _opt_run(root, opt, lr, seed, loss):
  name = f"{opt}-lr{lr:g}-s{seed}"
  _write_run(root / name, 4, seed, loss)
  path = root / name / "config.json"
  record = json.loads(path.read_text())
  record["train"].update(optimizer=opt, lr=lr)
  path.write_text(json.dumps(record))
  _with_init(root, name)
  return name


def test_sensitivity_per_optimizer_over_its_own_grid_with_a_ci_to_adamw(tmp_path):
  # Each optimizer on its own grid, the same factors (1/3, 1, 3) of its own centre lr:
  # Lion's is 3x lower. AdamW is flat over its grid, Lion falls off a cliff at its top.
  losses = {("adamw", 1e-3): 2.30, ("adamw", 3e-3): 2.20, ("adamw", 9e-3): 2.25,
            ("lion", 3e-4): 2.40, ("lion", 1e-3): 2.20, ("lion", 3e-3): 4.00}
  noise = {0: 0.0, 1: 0.02, 2: -0.01}  # Per seed, on each run of Lion's grid only.
  names = [_opt_run(tmp_path, opt, lr, s, loss + (noise[s] if opt == "lion" else 0.0))
           for (opt, lr), loss in losses.items() for s in range(3)]
  (tmp_path / "sweep.json").write_text(json.dumps({"points": [{"name": n} for n in names]}))
  paths = report.write_report(str(tmp_path))
  md = open(paths["lr_markdown"]).read()
  rows = {l.split(" | ")[0][2:]: l for l in md.splitlines() if l.startswith("| ")}
  adamw = statistics.fmean([2.30, 2.20, 2.25]) - 2.20
  lion = [statistics.fmean([2.40 + e, 2.20 + e, 4.00 + e]) - (2.20 + e) for e in noise.values()]
  assert "| 0.003 | 0.001 0.003 0.009 |" in rows["adamw"] and "| baseline |" in rows["adamw"]
  assert "| 0.001 | 0.0003 0.001 0.003 |" in rows["lion"]
  assert f"| {adamw:.4f} ± 0.0000 (n=3) |" in rows["adamw"]
  # Lion's sensitivity against AdamW's, paired by seed: a 3-seed interval that excludes 0.
  d, lo, hi, p = report_stats.paired(lion, [adamw] * 3)
  assert lo > 0 and d == pytest.approx(statistics.fmean(lion) - adamw)
  assert f"| {report_stats.interval_cell(d, lo, hi, p)} | 0/9 |" in rows["lion"], md

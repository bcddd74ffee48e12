"""Fits of loss against compute on synthetic data with a known law, and the best-lr pick."""

import json
import math
import random

import numpy as np
import pytest

from experiments import report
from experiments.report import fits as report_fits
from tests.experiments.test_report import _write_run

pytest.importorskip("scipy")
E, A, ALPHA, C0 = 2.0, 1.5, 0.3, 1e11
K = {4: 1.0, 2: 1 / 1.5, 1: 1.5}  # num_kv_heads -> compute multiplier against K=4.


def _groups(seeds=3, noise=0.003):
  """Groups as report.group_rows makes them: variant K's loss is the law at C / K[k]."""
  rng = random.Random(1)
  out = []
  for kv, k in K.items():
    for c in np.geomspace(1e10, 1e12, 6):
      loss = E + A * (c / k / C0) ** -ALPHA
      out.append({"label": f"kv{kv}-{c:.0e}", "model.num_kv_heads": kv, "train.steps": int(c),
                  "n": seeds, "_values": {"flops": [float(c)] * seeds,
                                          "final_loss": [loss + rng.gauss(0, noise)
                                                         for _ in range(seeds)]}})
  return out


def test_the_fit_recovers_a_known_law_and_its_compute_multipliers():
  fits = {r["variant"]: r for r in report_fits.fit_all(
      _groups(), ["model.num_kv_heads", "train.steps"], replicates=60)}
  assert list(fits) == ["num_kv_heads=4", "num_kv_heads=2", "num_kv_heads=1"]
  base = fits["num_kv_heads=4"]
  assert base["baseline"] and base["points"] == 6
  assert base["E"] == pytest.approx(E, abs=0.05) and base["alpha"] == pytest.approx(ALPHA, abs=0.05)
  assert base["alpha_lo"] <= ALPHA <= base["alpha_hi"]
  for kv in (2, 1):
    r = fits[f"num_kv_heads={kv}"]
    assert r["multiplier"] == pytest.approx(K[kv], rel=0.05)
    assert r["multiplier_lo"] <= K[kv] <= r["multiplier_hi"]
    assert r["multiplier_hi"] - r["multiplier_lo"] < 0.3  # A real interval, not [0, inf].
  # The worse variant needs more than any compute it was measured at: labelled.
  assert fits["num_kv_heads=1"]["extrapolated"] and not fits["num_kv_heads=2"]["extrapolated"]
  text = report_fits.markdown(list(fits.values()))
  assert "(extrapolated)" in text and "1 (baseline)" in text
  assert "num_kv_heads=2 reaches num_kv_heads=4's loss with 0.6" in text


def test_a_law_is_not_fitted_to_fewer_than_3_points():
  assert report_fits.fit_law([1.0, 2.0, 2.0], [3.0, 2.0, 2.1]) is None
  assert report_fits.frontier([(1, 3.0), (2, 3.1), (3, 2.5)]) == [(1, 3.0), (3, 2.5)]


def _lr_run(root, kv, lr, seed, loss):
  name = f"kv{kv}-lr{lr:g}-s{seed}"
  _write_run(root / name, kv, seed, loss)
  path = root / name / "config.json"
  record = json.loads(path.read_text())
  record["train"]["lr"] = lr
  path.write_text(json.dumps(record))
  return name


def test_each_variant_at_its_own_best_lr_with_the_edge_flagged(tmp_path):
  # kv4 is best at the middle lr; kv2 keeps improving to the grid's largest lr.
  losses = {(4, 1e-3): 2.4, (4, 3e-3): 2.1, (4, 1e-2): 2.3,
            (2, 1e-3): 2.6, (2, 3e-3): 2.4, (2, 1e-2): 2.2}
  names = [_lr_run(tmp_path, kv, lr, s, loss + 0.01 * s)
           for (kv, lr), loss in losses.items() for s in range(2)]
  (tmp_path / "sweep.json").write_text(json.dumps({"points": [{"name": n} for n in names]}))
  paths = report.write_report(str(tmp_path))
  md = open(paths["lr_markdown"]).read()
  assert "| kv4 | 0.003 | 0.001 0.003 0.01 | 2.1050 ± 0.0071 | baseline | 2† |" in md
  assert "| kv2 | 0.01 (edge) | 0.001 0.003 0.01 | 2.2050 ± 0.0071 | +0.1000" in md
  assert "widen the grid" in md and "at the grid's edge: kv2" in paths.notes
  assert math.isfinite(float(md.split("+0.1000 [")[1].split(",")[0]))

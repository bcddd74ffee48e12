"""The benchmark's MFU is model/flops.py's per-device formula (no compiles)."""

import pytest

from benchmarks.train_speed import add_mfu, best_peak
from model.flops import mfu


def test_add_mfu_uses_the_per_device_formula():
  r = {"dtype": "bfloat16", "tokens_per_s": 1e4, "flops_per_token": 1e6}
  peaks = {"float32": 4e10, "bfloat16": 1e11}
  out = add_mfu(r, peaks)
  assert out["mfu"] == pytest.approx(0.1) == mfu(1e4, 1e6, 1e11, 1)
  assert out["mfu_vs_f32_peak"] == pytest.approx(0.25)
  # The same job on 4 devices uses each of them a quarter as much.
  assert add_mfu(r, peaks, num_devices=4)["mfu"] == pytest.approx(0.025)


def test_mfu_denominator_is_the_best_peak_of_the_run():
  # A probe timed under load (72 GFLOP/s) must not become the denominator when the
  # run saw 149 (start) or PyTorch's 153: that gave "127% MFU" for the reference.
  roofline = {"float32": 149e9, "bfloat16": 95e9, "torch_float32": 153e9}
  peak = best_peak(roofline, {"float32": [72e9, 99e9], "bfloat16": [22e9, 101e9]})
  assert peak == {"float32": 153e9, "bfloat16": 101e9}
  # The reference at M ran 572 tok/s x 160.5 MFLOP/token = 91.8 GFLOP/s.
  r = add_mfu({"dtype": "float32", "tokens_per_s": 572, "flops_per_token": 160.5e6}, peak)
  assert 0 < r["mfu"] <= 1 and r["mfu"] == pytest.approx(0.6, abs=0.01)
  # No torch figure (torch not installed): the JAX peaks alone.
  assert best_peak({"float32": 1e9, "bfloat16": 2e9, "torch_float32": None}, {}) == {
      "float32": 1e9, "bfloat16": 2e9}

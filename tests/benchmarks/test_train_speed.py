"""The benchmark's MFU is model/flops.py's per-device formula (no compiles)."""

import pytest

from benchmarks.train_speed import add_mfu
from model.flops import mfu


def test_add_mfu_uses_the_per_device_formula():
  r = {"dtype": "bfloat16", "tokens_per_s": 1e4, "flops_per_token": 1e6}
  peaks = {"float32": 4e10, "bfloat16": 1e11}
  out = add_mfu(r, peaks)
  assert out["mfu"] == pytest.approx(0.1) == mfu(1e4, 1e6, 1e11, 1)
  assert out["mfu_vs_f32_peak"] == pytest.approx(0.25)
  # The same job on 4 devices uses each of them a quarter as much.
  assert add_mfu(r, peaks, num_devices=4)["mfu"] == pytest.approx(0.025)

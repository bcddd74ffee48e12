"""The roofline: the device's matmul peak, measured by a jitted matmul in this run.

float32, and bfloat16 inputs with float32 accumulation (`preferred_element_type`,
what the model's Einsum does). A peak is what the device does when nothing gets in
the way, so it is the best time seen, and on a shared machine it is sought twice:

- `run`: best of several repeats at a few sizes, at the start of the run;
- `Probe`: a few matmuls as one more contender in the round-robin timing of the
  train steps (common.interleaved_times), keeping its best single matmul each round,
  so a quiet moment anywhere in the training section raises the peak.

Every MFU of the run divides by the largest of these (train_speed.run): one
denominator for this project and the reference, never flattered by a busy start.
PyTorch's float32 matmul peak is recorded beside them (not used for MFU).
"""

from __future__ import annotations

import time
import jax
import jax.numpy as jnp

from benchmarks.common import Mode
from train.peak import measure_peak_flops

SIZES = (1024, 2048)
CONTENDER_SIZE, CONTENDER_CALLS = 1024, 4


class Probe:
  """A call runs `calls` blocking n x n matmuls and records the fastest one's FLOP/s."""

  def __init__(self, dtype: str, n: int = CONTENDER_SIZE, calls: int = CONTENDER_CALLS):
    self.a = jnp.ones((n, n), dtype)
    self.mm = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
    self.mm(self.a, self.a).block_until_ready()
    self.flops, self.calls, self.rates = 2.0 * n ** 3, calls, []

  def __call__(self) -> None:
    best = float("inf")
    for _ in range(self.calls):
      t0 = time.perf_counter()
      self.mm(self.a, self.a).block_until_ready()
      best = min(best, time.perf_counter() - t0)
    self.rates.append(self.flops / best)


def torch_peak(n: int = 1024, repeats: int = 5) -> float | None:
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  a = torch.ones((n, n), dtype=torch.float32)
  torch.mm(a, a)
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    torch.mm(a, a)
    best = min(best, time.perf_counter() - t0)
  return 2 * n ** 3 / best


def run(mode: Mode) -> dict:
  """{"float32", "bfloat16": best FLOP/s per device, "sizes", "torch_float32"}."""
  sizes = (256,) if mode.smoke else SIZES
  repeats = 2 if mode.smoke else 5
  out = {"sizes": list(sizes)}
  for dtype in ("float32", "bfloat16"):
    out[dtype] = max(measure_peak_flops(dtype, n, repeats) for n in sizes)
    print(f"matmul peak {dtype}: {out[dtype] / 1e9:.1f} GFLOP/s", flush=True)
  out["torch_float32"] = max((torch_peak(n, repeats) or 0.0) for n in sizes) or None
  if out["torch_float32"]:
    print(f"torch matmul peak float32: {out['torch_float32'] / 1e9:.1f} GFLOP/s", flush=True)
  return out

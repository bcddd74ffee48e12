"""The device peak an MFU is measured against, and where it came from.

In order: `hardware.peak_flops` (per device) when set; the published dense peak of
the device kind in the compute dtype (`PUBLISHED`); else a jitted matmul timed at
startup, best of several repeats. A timed peak on a busy machine is no peak: when
training runs faster than it, the peak is measured again and raised to at least the
achieved rate, with a warning; any peak the run outpaces is reported, and a logged
MFU never exceeds 1.
"""

from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp

log = logging.getLogger(__name__)

# Dense (no sparsity) peak FLOP/s per device, by a substring of jax's device_kind: bf16,
# and float32 matmuls (TF32 on NVIDIA GPUs, bf16 passes on TPUs). Vendors' data sheets.
PUBLISHED = {
    "TPU v4": {"bfloat16": 275e12, "float32": 275e12},
    "TPU v5 lite": {"bfloat16": 197e12, "float32": 197e12},
    "TPU v5p": {"bfloat16": 459e12, "float32": 459e12},
    "TPU v6 lite": {"bfloat16": 918e12, "float32": 918e12},
    "A100": {"bfloat16": 312e12, "float32": 156e12},
    "H100": {"bfloat16": 989e12, "float32": 494e12},
    "H200": {"bfloat16": 989e12, "float32": 494e12},
    "B200": {"bfloat16": 2250e12, "float32": 1100e12},
}
MAX_REMEASURES = 3  # Then the peak is only raised to what the run achieves.


def published_peak(device_kind: str, dtype: str) -> float | None:
  for kind, peaks in PUBLISHED.items():
    if kind.lower() in device_kind.lower():
      return peaks.get(dtype)
  return None


def measure_peak_flops(dtype: str = "float32", n: int = 1024, repeats: int = 5) -> float:
  """Per-device matmul FLOP/s of a jitted n x n matmul in `dtype` (float32 accumulate)."""
  a = jnp.ones((n, n), dtype)
  mm = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
  mm(a, a).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    t = time.perf_counter()
    mm(a, a).block_until_ready()
    best = min(best, time.perf_counter() - t)
  return 2 * n ** 3 / best


class Peak:
  """The per-device peak of this run's MFU; `utilization(achieved)` is MFU <= 1."""

  def __init__(self, configured: float, dtype: str, device_kind: str, repeats: int = 10):
    self.dtype, self.repeats, self.remeasures = dtype, repeats, 0
    published = published_peak(device_kind, dtype)
    self.measured = not configured and published is None
    if configured:
      self.value, self.source = float(configured), "hardware.peak_flops"
    elif published is not None:
      self.value, self.source = published, f"the published {dtype} peak of a {device_kind}"
    else:
      self.value = measure_peak_flops(dtype, repeats=repeats)
      self.source = (f"measured at startup: the best of {repeats} jitted 1024x1024 {dtype} "
                     f"matmuls on a {device_kind} (set hardware.peak_flops to its published "
                     "figure for a stable MFU)")
    log.info("MFU peak: %.3g FLOP/s per device, %s", self.value, self.source)

  def utilization(self, achieved: float) -> float:
    """MFU of `achieved` FLOP/s per device; never above 1."""
    if achieved > self.value:
      old = self.value
      if self.measured and self.remeasures < MAX_REMEASURES:
        self.remeasures += 1
        self.value = max(self.value, measure_peak_flops(self.dtype, repeats=self.repeats))
      self.value = max(self.value, achieved)
      log.warning("training ran at %.3g FLOP/s per device, above the MFU peak of %.3g (%s): "
                  "that was no peak (%s); the peak is now %.3g", achieved, old, self.source,
                  "measured on a busy machine?" if self.measured else "check the figure",
                  self.value)
    return min(achieved / self.value, 1.0)

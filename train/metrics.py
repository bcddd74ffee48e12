"""metrics.jsonl + TensorBoard writers, the progress line, and the device peak for MFU."""

from __future__ import annotations

import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp

METRICS_FILE = "metrics.jsonl"


def read_metrics(workdir: str) -> list[dict]:
  path = os.path.join(workdir, METRICS_FILE)
  if not os.path.exists(path):
    return []
  out = []
  with open(path) as f:
    for line in f:
      line = line.strip()
      if line:
        try:
          out.append(json.loads(line))
        except json.JSONDecodeError:
          continue  # A line cut by a kill mid-write; resume rewrites it.
  return out


class MetricsWriter:
  """Appends JSON lines (and TensorBoard scalars) on the primary process only."""

  def __init__(self, workdir: str, enabled: bool, tensorboard: bool = True):
    self.enabled = enabled
    self.path = os.path.join(workdir, METRICS_FILE)
    self.tb = None
    if enabled and tensorboard:
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
      self.tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def truncate_after(self, step: int) -> None:
    """Keeps every line up to `step`: a resumed run rewrites what came after."""
    if not self.enabled or not os.path.exists(self.path):
      return
    kept = [r for r in read_metrics(os.path.dirname(self.path)) if r.get("step", 0) <= step]
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      for r in kept:
        f.write(json.dumps(r) + "\n")
    os.replace(tmp, self.path)

  def write(self, record: dict) -> None:
    if not self.enabled:
      return
    clean = {k: _plain(v) for k, v in record.items()}
    with open(self.path, "a") as f:
      f.write(json.dumps(clean) + "\n")
    if self.tb is not None:
      split = clean.get("split", "train")
      for k, v in clean.items():
        if isinstance(v, (int, float)) and k != "step" and math.isfinite(v):
          self.tb.add_scalar(f"{split}/{k}", v, clean["step"])

  def close(self) -> None:
    if self.tb is not None:
      self.tb.close()


def _plain(v):
  if hasattr(v, "item"):
    v = v.item()
  if isinstance(v, float) and not math.isfinite(v):
    return str(v)  # JSON has no NaN; keep it visible as a string.
  return v


class Progress:
  """One line per log step: step, loss, tokens/s and ETA."""

  def __init__(self, total_steps: int, enabled: bool):
    self.total, self.enabled = total_steps, enabled
    self.t0, self.s0 = time.time(), None

  def update(self, step: int, loss: float, tokens_per_s: float, mfu: float) -> None:
    if not self.enabled:
      return
    if self.s0 is None:
      self.s0, self.t0 = step, time.time()
      eta = float("nan")
    else:
      rate = (step - self.s0) / max(time.time() - self.t0, 1e-9)
      eta = (self.total - step) / rate if rate > 0 else float("nan")
    eta_s = "?" if not math.isfinite(eta) else time.strftime("%H:%M:%S", time.gmtime(eta))
    print(f"step {step:>6}/{self.total}  loss {loss:.4f}  {tokens_per_s:,.0f} tok/s  "
          f"MFU {100 * mfu:.1f}%  ETA {eta_s}", file=sys.stderr, flush=True)


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

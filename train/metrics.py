"""metrics.jsonl + TensorBoard writers, the progress line, and the device peak for MFU."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

METRICS_FILE = "metrics.jsonl"
REWOUND_FILE = "metrics.rewound.jsonl"  # Lines after a resumed checkpoint.

log = logging.getLogger(__name__)


def read_metrics(workdir: str, warn: bool = True) -> list[dict]:
  """The metrics.jsonl records in order. A line that is not JSON (the last one cut
  by a crash mid-write, typically) is skipped with a warning naming it."""
  path = os.path.join(workdir, METRICS_FILE)
  if not os.path.exists(path):
    return []
  out = []
  with open(path) as f:
    lines = f.readlines()
  for i, line in enumerate(lines, 1):
    line = line.strip()
    if not line:
      continue
    try:
      out.append(json.loads(line))
    except json.JSONDecodeError:
      if warn:
        where = "the last line" if i == len(lines) else f"line {i} of {len(lines)}"
        log.warning("%s: %s is not JSON (cut by a crash mid-write?); skipped: %.80r",
                    path, where, line)
  return out


class MetricsWriter:
  """Appends JSON lines on the primary process only, and to TensorBoard: every number
  as a scalar, every vector (MoE `moe_load/layer<i>`: routed tokens per expert) as a
  histogram, the run's config.json as text at the start, and at the final eval
  (step == train.steps) the config's fields as hparams with the final eval figures
  (TensorBoard's HParams tab then compares the runs of a sweep)."""

  def __init__(self, workdir: str, enabled: bool, tensorboard: bool = True):
    self.enabled = enabled
    self.path = os.path.join(workdir, METRICS_FILE)
    self.tb = None
    self.config = None  # config.json (the loop writes it before training starts).
    if enabled and tensorboard:
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
      self.tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
      config_path = os.path.join(workdir, "config.json")
      if os.path.exists(config_path):
        with open(config_path) as f:
          self.config = json.load(f)
        # Markdown code block: TensorBoard's text tab keeps the indentation.
        text = json.dumps(self.config, indent=2, sort_keys=True)
        self.tb.add_text("config", "    " + text.replace("\n", "\n    "), 0)

  def truncate_after(self, step: int) -> int:
    """A resumed run rewrites the lines after its checkpoint's `step`: they move to
    metrics.rewound.jsonl (kept, never deleted). Returns how many moved."""
    if not self.enabled or not os.path.exists(self.path):
      return 0
    records = read_metrics(os.path.dirname(self.path))
    kept = [r for r in records if r.get("step", 0) <= step]
    rewound = [r for r in records if r.get("step", 0) > step]
    if not rewound and len(kept) == len(records):
      return 0
    with open(os.path.join(os.path.dirname(self.path), REWOUND_FILE), "a") as f:
      for r in rewound:
        f.write(json.dumps({**r, "rewound_to": step}) + "\n")
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      for r in kept:
        f.write(json.dumps(r) + "\n")
    os.replace(tmp, self.path)
    return len(rewound)

  def write(self, record: dict) -> None:
    if not self.enabled:
      return
    clean = {k: _plain(v) for k, v in record.items()}
    with open(self.path, "a+b") as f:
      cut = False
      if f.seek(0, os.SEEK_END) > 0:
        f.seek(-1, os.SEEK_END)
        cut = f.read(1) != b"\n"
      # A line cut by a crash stays visible as itself; the new line starts afresh.
      f.write((("\n" if cut else "") + json_line(clean)).encode())
    if self.tb is not None:
      split = clean.get("split", "train")
      for k, v in clean.items():
        if isinstance(v, (int, float)) and k != "step" and math.isfinite(v):
          self.tb.add_scalar(f"{split}/{k}", v, clean["step"])
        elif isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v):
          self.tb.add_histogram(f"{split}/{k}", np.asarray(v, np.float64), clean["step"])
      if split == "eval" and self.config is not None and (
          clean["step"] == self.config.get("train", {}).get("steps")):
        self._hparams(clean)

  def _hparams(self, final_eval: dict) -> None:
    """The run's config fields (dotted paths; tuples as text) -> the final eval figures."""
    hparams = {k: v if isinstance(v, (bool, int, float, str)) else str(v)
               for k, v in _flatten(self.config).items() if not k.startswith("_run.")}
    figures = {f"final/{k}": float(v) for k, v in final_eval.items()
               if k not in ("step", "split") and isinstance(v, (int, float)) and math.isfinite(v)}
    self.tb.add_hparams(hparams, figures, name="hparams", global_step=final_eval["step"])

  def close(self) -> None:
    if self.tb is not None:
      self.tb.close()


def _flatten(d: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def json_line(record: dict) -> str:
  """One metrics line: numpy scalars as numbers, non-finite values as null."""
  return json.dumps({k: _plain(v) for k, v in record.items()}, allow_nan=False,
                    default=list) + "\n"


def _plain(v):
  if isinstance(v, (list, tuple)):
    return [_plain(x) for x in v]
  if hasattr(v, "item"):
    v = v.item()
  if isinstance(v, float) and not math.isfinite(v):
    return None  # JSON has no NaN or infinity: null, which every JSON reader takes.
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

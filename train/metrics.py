"""metrics.jsonl + TensorBoard writers and the progress line (the MFU peak: train/peak.py)."""

from __future__ import annotations

import json
import logging
import math
import os
import posixpath
import re
import secrets
import shutil
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from train.io import runlog, staging, storage

METRICS_FILE = "metrics.jsonl"
REWOUND_FILE = "metrics.rewound.jsonl"  # Lines after a resumed checkpoint.

SYNC_S = 60.0  # On a bucket, buffered lines are written at least this often.

log = logging.getLogger(__name__)


def read_metrics(workdir: str, warn: bool = True) -> list[dict]:
  """The metrics.jsonl records in order (on a bucket, its segments: train/io/runlog.py). A
  line that is not JSON (the last one cut by a crash mid-write) is skipped with a warning
  naming it."""
  return runlog.read_records(workdir, METRICS_FILE, warn)


class MetricsWriter:
  """Appends JSON lines on the primary process only, and hands each record to the
  dashboards beside it: TensorBoard (train.tensorboard) and Weights & Biases
  (train.wandb_project). Each gets every number as a scalar and every vector (MoE
  `moe_load/layer<i>`: routed tokens per expert; `moe_bias/layer<i>`: the loss-free
  balancing biases) as a histogram, and the run's config.json."""

  def __init__(self, workdir: str, enabled: bool, tensorboard: bool = True,
               wandb_project: str = ""):
    self.enabled, self.workdir = enabled, workdir
    self.log = runlog.Log(workdir, METRICS_FILE)
    # On a bucket, lines wait for `sync` (before each checkpoint, at close, SYNC_S): one object
    # per sync, never a request per step.
    self.buffered = storage.is_url(workdir)
    self.pending: list[str] = []
    self.synced_at = time.time()
    self.sinks = []
    if not enabled:
      return
    config = None  # config.json (the loop writes it before training starts).
    config_path = storage.join(workdir, "config.json")
    if storage.exists(config_path):
      config = json.loads(storage.read_text(config_path))
    if tensorboard:
      self.sinks.append(_TensorBoard(workdir, config))
    if wandb_project:
      self.sinks.append(_WandB(workdir, wandb_project, config))

  def truncate_after(self, step: int) -> int:
    """A resumed run rewrites the lines after its checkpoint's `step`: they move to
    metrics.rewound.jsonl (kept, never deleted). Returns how many moved. On a bucket the
    metrics stream gets a rewind marker instead of being rewritten (train/io/runlog.py)."""
    if not self.enabled or not runlog.exists(self.workdir, METRICS_FILE):
      return 0
    records = read_metrics(self.workdir)
    kept = [r for r in records if r.get("step", 0) <= step]
    rewound = [r for r in records if r.get("step", 0) > step]
    if not rewound:
      return 0
    runlog.append(self.workdir, REWOUND_FILE,
                  [json.dumps({**r, "rewound_to": step}) + "\n" for r in rewound])
    if self.buffered:
      self.log.rewind(step)
    else:
      storage.write_text(storage.join(self.workdir, METRICS_FILE),
                         "".join(json.dumps(r) + "\n" for r in kept))
    return len(rewound)

  def write(self, record: dict) -> None:
    if not self.enabled:
      return
    clean = {k: _plain(v) for k, v in record.items()}
    self.pending.append(json_line(clean))
    if not self.buffered or time.time() - self.synced_at >= SYNC_S:
      self.sync()
    split = clean.get("split", "train")
    scalars = {f"{split}/{k}": v for k, v in clean.items() if k != "step"
               and isinstance(v, (int, float)) and math.isfinite(v)}
    vectors = {f"{split}/{k}": np.asarray(v, np.float64) for k, v in clean.items()
               if isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v)}
    for sink in self.sinks:
      sink.write(clean["step"], split, scalars, vectors, clean)

  def sync(self) -> None:
    """Writes the lines not yet written (a bucket: one segment) and the dashboards' files."""
    if not self.enabled:
      return
    self.log.append(self.pending)
    self.pending, self.synced_at = [], time.time()
    if self.buffered:
      for sink in self.sinks:
        sink.sync()

  def close(self) -> None:
    self.sync()
    for sink in self.sinks:
      sink.close()


def _tb_tag(tag: str) -> str:
  """TensorBoard's own spelling of a tag ("loss@256" -> "loss_256"), done here so that
  tensorboardX never renames one itself, logging "Summary name ... is illegal" each time."""
  return re.sub(r"[^\w./-]", "_", tag)


class _TensorBoard:
  """RUN/tensorboard: the config as text at the start and, at the final eval (step ==
  train.steps), the config's fields as hparams with the final eval figures
  (TensorBoard's HParams tab then compares the runs of a sweep)."""

  def __init__(self, workdir: str, config: dict | None):
    self.dir = storage.join(workdir, "tensorboard")
    # On a bucket, event files are written locally and each uploaded once, complete, at
    # `sync` (a new object per sync; TensorBoard reads every event file of a directory).
    self.upload = storage.is_url(workdir)
    self.local = tempfile.mkdtemp(prefix="tensorboard-") if self.upload else self.dir
    self.tb, self.files = None, 0
    self.config = config
    if config is not None:
      # Markdown code block: TensorBoard's text tab keeps the indentation.
      text = json.dumps(config, indent=2, sort_keys=True)
      self._writer().add_text("config", "    " + text.replace("\n", "\n    "), 0)

  def _writer(self):
    if self.tb is None:
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
      self.files += 1
      self.tb = SummaryWriter(self.local, filename_suffix=f".{self.files}")
    return self.tb

  def sync(self) -> None:
    if not self.upload or self.tb is None:
      return
    self.tb.close()
    self.tb = None
    staging.upload_dir(self.local, self.dir)  # add_hparams writes in a subdirectory too.
    shutil.rmtree(self.local)
    os.makedirs(self.local)

  def write(self, step: int, split: str, scalars: dict, vectors: dict, record: dict) -> None:
    for tag, v in scalars.items():
      self._writer().add_scalar(_tb_tag(tag), v, step)
    for tag, v in vectors.items():
      self._writer().add_histogram(_tb_tag(tag), v, step)
    if split == "eval" and self.config is not None and (
        step == self.config["train"]["steps"]):  # config.json always records it.
      self._hparams(record)

  def _hparams(self, final_eval: dict) -> None:
    """The run's config fields (dotted paths; tuples as text) -> the final eval figures."""
    hparams = {k: v if isinstance(v, (bool, int, float, str)) else str(v)
               for k, v in _flatten(self.config).items() if not k.startswith("_run.")}
    figures = {_tb_tag(f"final/{k}"): float(v) for k, v in final_eval.items()
               if k not in ("step", "split") and isinstance(v, (int, float)) and math.isfinite(v)}
    self._writer().add_hparams(hparams, figures, name="hparams",
                               global_step=final_eval["step"])

  def close(self) -> None:
    self.sync()
    if self.tb is not None:
      self.tb.close()
    if self.upload:
      shutil.rmtree(self.local, ignore_errors=True)


WANDB_ID_FILE = "wandb_run_id"  # The run's W&B id: a resume continues the same W&B run.


class _WandB:
  """A Weights & Biases run (train.wandb_project) with the resolved config; its files go
  to RUN/wandb/ (WANDB_MODE=offline: there only, for `wandb sync` later). Metrics are
  logged against their own `step` field, so lines logged again after a resume rewinds
  (metrics.rewound.jsonl) are kept, not refused as out of order."""

  def __init__(self, workdir: str, project: str, config: dict | None):
    import wandb  # pylint: disable=g-import-not-at-top  (optional: validation checked it)
    id_path = storage.join(workdir, WANDB_ID_FILE)
    if storage.exists(id_path):
      run_id = storage.read_text(id_path).strip()
    else:
      run_id = secrets.token_hex(4)  # W&B ids: letters and digits.
      storage.write_text(id_path, run_id + "\n")
    self.wandb = wandb
    # W&B's own files need a local directory: on a bucket, a temporary one.
    self.run = wandb.init(project=project, id=run_id, resume="allow",
                          dir=storage.local_path(workdir) or tempfile.mkdtemp(prefix="wandb-"),
                          name=posixpath.basename(str(workdir).rstrip("/")), config=config,
                          settings=wandb.Settings(console="off"))
    self.run.define_metric("step")
    for split in ("train", "eval"):
      self.run.define_metric(f"{split}/*", step_metric="step")

  def write(self, step: int, split: str, scalars: dict, vectors: dict, record: dict) -> None:
    data = {"step": step, **scalars}
    data.update({tag: self.wandb.Histogram(v) for tag, v in vectors.items()})
    self.run.log(data)

  def sync(self) -> None:
    pass  # W&B uploads on its own.

  def close(self) -> None:
    self.run.finish()


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
    print(f"step {step:>6}/{self.total}  loss {loss:.4f}  {tokens_per_s:,.0f} tok/s  "
          f"MFU {100 * mfu:.1f}%  ETA {_hms(eta)}", file=sys.stderr, flush=True)


def _hms(seconds: float) -> str:
  if not math.isfinite(seconds):
    return "?"
  return time.strftime("%H:%M:%S", time.gmtime(seconds))


class Countdown:
  """Long work item by item (sweep points, benchmark sections): `tick()` returns
  "3/8 done, 00:12:40 elapsed, ETA 00:21:06" (the mean time per item so far)."""

  def __init__(self, total: int):
    self.total, self.done, self.t0 = total, 0, time.time()

  def tick(self, n: int = 1) -> str:
    self.done += n
    elapsed = time.time() - self.t0
    eta = elapsed / self.done * (self.total - self.done) if self.done else float("nan")
    return f"{self.done}/{self.total} done, {_hms(elapsed)} elapsed, ETA {_hms(eta)}"


def progress(items, total: int, desc: str, unit: str = "it"):
  """Yields `items`, showing progress: a tqdm bar when stderr is a terminal (and tqdm
  is installed), else an INFO log line at each tenth, so logs and tests stay clean."""
  if sys.stderr.isatty():
    try:
      from tqdm import tqdm  # pylint: disable=g-import-not-at-top
    except ImportError:
      pass
    else:
      yield from tqdm(items, total=total, desc=desc, unit=unit, leave=False)
      return
  countdown, every = Countdown(total), max(total // 10, 1)
  for i, item in enumerate(items, 1):
    yield item
    text = countdown.tick()
    if i % every == 0 or i == total:
      log.info("%s: %s", desc, text)

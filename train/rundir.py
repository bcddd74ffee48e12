"""The run directory as a lab notebook: what it holds, who writes it, what changed.

- `contents(workdir)`: what a directory already holds (config, logged steps,
  checkpoints), so that a writer can refuse to overwrite a run and say what it found.
- `WorkdirLock`: one trainer per run directory (process 0 holds `RUN/LOCK`).
- `config_changes` / `record_changes` / `read_changes`: a resumed run whose
  config differs from config.json is refused unless the change is deliberate;
  deliberate changes are appended to `RUN/config_changes.jsonl` with their step.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import sys
from typing import Any

log = logging.getLogger(__name__)

LOCK_FILE = "LOCK"
CHANGES_FILE = "config_changes.jsonl"

# Fields that change how a run is operated, not what it computes: they may change
# on resume without a flag (and are still recorded). `train.steps` is here because
# raising it is how a run is continued.
OPERATIONAL = frozenset({
    "name", "train.steps", "train.log_every", "train.eval_every", "train.checkpoint_every",
    "train.keep_checkpoints", "train.keep_every", "train.async_checkpoint",
    "train.tensorboard", "train.on_nonfinite", "data.worker_count", "hardware.peak_flops",
    "train.profile_steps", "train.profile_start", "train.wandb_project",
    "model.scan_unroll",  # The same parameters and numbers (tests/model/test_transformer.py).
    # Blockwise attention's blocks: the same function, sums in another order (equal to
    # the reference within float tolerance: tests/model/test_attention_impl.py).
    "model.attention_block_q", "model.attention_block_kv",
})
OPERATIONAL_PREFIXES = ("mesh.",)  # Restores reshard; results agree across meshes (tested).


def _now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# What a directory holds ------------------------------------------------------------


def contents(workdir: str) -> list[str]:
  """Human-readable items that make `workdir` a run ([] for a new or empty directory)."""
  from train.metrics import read_metrics  # pylint: disable=g-import-not-at-top
  found = []
  if os.path.exists(os.path.join(workdir, "config.json")):
    found.append("config.json")
  records = read_metrics(workdir, warn=False)
  if records:
    found.append(f"metrics.jsonl with {len(records)} lines up to step "
                 f"{max(r.get('step', 0) for r in records)}")
  ckpt_dir = os.path.join(workdir, "checkpoints")
  steps = sorted(int(n) for n in (os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else [])
                 if n.isdigit())
  if steps:
    found.append(f"checkpoints at steps {steps}")
  return found


# One writer per run directory -------------------------------------------------------


class LockError(RuntimeError):
  pass


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


class WorkdirLock:
  """`RUN/LOCK` (created exclusively) names its holder: host, pid, start time, command.

  A lock whose holder ran on this host and is no longer alive is stale (a killed
  job): it is taken over with a warning. One held by a live process, or by a
  process on another host (whose liveness cannot be checked from here), is refused
  with the holder's details and how to clear it.
  """

  def __init__(self, workdir: str, enabled: bool = True):
    self.path = os.path.join(workdir, LOCK_FILE)
    self.enabled = enabled
    self.held = False

  def _holder(self) -> dict:
    try:
      with open(self.path) as f:
        return json.load(f)
    except (OSError, ValueError):
      return {}

  def _try_create(self) -> bool:
    record = {"host": socket.gethostname(), "pid": os.getpid(), "since": _now(),
              "command": " ".join(sys.argv)}
    try:
      fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
      return False
    with os.fdopen(fd, "w") as f:
      json.dump(record, f)
    return True

  def acquire(self) -> None:
    if not self.enabled:
      return
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    for _ in range(2):
      if self._try_create():
        self.held = True
        return
      holder = self._holder()
      host, pid = holder.get("host"), holder.get("pid")
      who = (f"pid {pid} on host {host} since {holder.get('since')} "
             f"(command: {holder.get('command')})")
      if host == socket.gethostname() and isinstance(pid, int) and pid != os.getpid():
        if _alive(pid):
          raise LockError(f"{os.path.dirname(self.path)} is in use by another trainer: {who}. "
                          "Wait for it to finish or stop it; two trainers on one run "
                          "directory would write every line twice.")
        log.warning("stale lock %s: its holder, %s, is no longer running (killed?); "
                    "taking it over", self.path, who)
        os.remove(self.path)
        continue
      raise LockError(
          f"{os.path.dirname(self.path)} is locked by {who}, which cannot be checked from "
          f"host {socket.gethostname()}. If that process is no longer running, delete "
          f"{self.path} and re-run.")
    raise LockError(f"could not take {self.path}: another process took it at the same time")

  def release(self) -> None:
    if self.held:
      self.held = False
      try:
        os.remove(self.path)
      except FileNotFoundError:
        pass

  def __enter__(self):
    self.acquire()
    return self

  def __exit__(self, *exc):
    self.release()


# Config changes on resume -----------------------------------------------------------


def flatten(d: dict, prefix: str = "", sequence: type = list) -> dict[str, Any]:
  """{"model": {"d_model": 64}} -> {"model.d_model": 64}; lists and tuples become
  `sequence` (list: as JSON has them; tuple: hashable, printed like the config)."""
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(flatten(v, f"{prefix}{k}.", sequence))
    else:
      out[f"{prefix}{k}"] = sequence(v) if isinstance(v, (list, tuple)) else v
  return out


def is_operational(field: str) -> bool:
  return field in OPERATIONAL or field.startswith(OPERATIONAL_PREFIXES)


def config_changes(saved: dict, current: dict) -> list[dict]:
  """[{field, old, new}] for every flattened field whose JSON value differs.

  A field that one side lacks (the code gained or lost a field) has old/new None.
  """
  a, b = flatten(saved), flatten(current)
  a.pop("_run", None)
  key = lambda v: json.dumps(v, sort_keys=True)
  return [{"field": f, "old": a.get(f), "new": b.get(f)} for f in sorted(set(a) | set(b))
          if not f.startswith("_run.") and key(a.get(f)) != key(b.get(f))]


def environment_changes(saved: dict, current: dict) -> list[dict]:
  """Code or device changes between the run's start (`_run`) and now: facts a reader
  of the results should see (a resume under another commit), never refused."""
  # Only what both record: provenance in `_run` (converted_from, eval_of...) is not
  # environment, and a fact an older run did not record has no old value to compare.
  return [{"field": f"_run.{k}", "old": saved[k], "new": current[k]}
          for k in sorted(current) if k in saved and saved[k] != current[k]]


def tokens_seen_at(workdir: str, step: int, tokens_per_step: int) -> int:
  """Training tokens consumed by `step`, across recorded batch/sequence changes: each
  change record carries the count at its step; the last segment runs at
  `tokens_per_step` (the config that trained it)."""
  base_step, base = 0, 0
  for r in read_changes(workdir):
    if "tokens_seen" in r and r["step"] <= step:
      base_step, base = r["step"], int(r["tokens_seen"])
  return base + (step - base_step) * tokens_per_step


def describe(changes: list[dict]) -> str:
  return "; ".join(f"{c['field']}: {c['old']!r} -> {c['new']!r}" for c in changes)


def record_changes(workdir: str, step: int, changes: list[dict], **extra: Any) -> None:
  """Appends one line per changed field: {step, field, old, new, time, ...extra}."""
  if not changes:
    return
  with open(os.path.join(workdir, CHANGES_FILE), "a") as f:
    for c in changes:
      f.write(json.dumps({"step": step, **c, "time": _now(), **extra}) + "\n")


def read_changes(workdir: str) -> list[dict]:
  """The config changes recorded in a run, in order ([] if none)."""
  path = os.path.join(workdir, CHANGES_FILE)
  if not os.path.exists(path):
    return []
  out = []
  with open(path) as f:
    for i, line in enumerate(f, 1):
      if line.strip():
        try:
          out.append(json.loads(line))
        except json.JSONDecodeError:
          log.warning("%s line %d is not JSON (cut by a crash?); skipped", path, i)
  return out

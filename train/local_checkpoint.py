"""The local checkpoint tier: frequent saves on the host's own disk, besides the run's.

Every `train.local_checkpoint_every` steps (0: off) the trainer also saves the same two
items as a persistent checkpoint ("state", "data": train/checkpoint.py) into a directory
on the host, keeping the newest `KEEP`. A resume takes the newest step of either tier
that restores (verified against its checksums); a local directory that is missing (a
run restarted on new hosts) or damaged falls back to the persistent checkpoints in the
run directory. A SIGKILL then loses at most `local_checkpoint_every` steps while the
hosts survive, and `checkpoint_every` steps when they do not (docs/scaling.md,
"Preemption").

Local saves are not committed saves of the run: RUN/checkpoints.jsonl never records
them, so "no save ever committed" (train/lifecycle/resume.py) still means the
persistent tier's.

Identity: the tier lives in `<root>/<digest of the run directory's URL>-<run_id>/`,
`run_id` being config.json's `_run.run_id` (made once when the run starts at step 0,
kept by every resume), and its `run.json` names the run directory and run_id. A run
directory re-created at the same path (a new run_id) or a copy of one (another URL)
never restores, nor overwrites, another run's local steps. `<root>` is
`train.local_checkpoint_dir`, by default `$TMPDIR/blockwork-local`.

Single process only: orbax writes each array shard from the process that owns it, so
on several hosts each host's local directory would hold its own shards and none a
whole checkpoint. orbax's emergency manager (orbax.checkpoint.experimental.emergency)
solves that by restoring from a peer slice, but it needs at least two data-parallel
slices and saves one pytree item; with `jax.process_count() > 1` the tier is off, with
a warning saying why.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import uuid
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import serialization

from train import checkpoint as ckpt
from train.io import checksums, storage

log = logging.getLogger(__name__)

KEEP = 2  # The newest local steps kept: a damaged newest falls back to the one before.
RUN_ID = "run_id"  # config.json `_run` field: this run's identity (made at step 0).
MARKER = "run.json"


def new_run_id() -> str:
  return uuid.uuid4().hex


def directory(train_cfg, workdir: str, run_id: str) -> str:
  """`<train.local_checkpoint_dir or $TMPDIR/blockwork-local>/<digest of the run
  directory's URL>-<run_id>`: two runs, or two copies of one, never share it."""
  root = (os.path.abspath(os.path.expanduser(str(train_cfg.local_checkpoint_dir)))
          if train_cfg.local_checkpoint_dir
          else os.path.join(tempfile.gettempdir(), "blockwork-local"))
  digest = hashlib.sha256(storage.absolute(workdir).encode()).hexdigest()[:16]
  return os.path.join(root, f"{digest}-{run_id}")


def _unsupported() -> str | None:
  if jax.process_count() > 1:
    return (f"{jax.process_count()} processes: each host's local directory would hold only "
            "its own shards, no whole checkpoint; the persistent checkpoints "
            "(train.checkpoint_every) are the only ones")
  return None


class LocalTier:
  """The run's local checkpoints: `every` = 0 (off) makes every method a no-op."""

  def __init__(self, every: int = 0, directory: str | None = None,
               manager: ocp.CheckpointManager | None = None):
    self.every, self.directory, self.manager = every, directory, manager
    self.restored = None  # The local step a resume restored (its path), if any.

  @classmethod
  def for_run(cls, config, workdir: str, record: dict | None,
              resuming: bool = False) -> "LocalTier":
    """The tier of the run whose config.json is `record` (off when not configured, not
    supported here, or the record has no run_id). `resuming`: only a directory that
    exists, and that names this run directory, is opened (a resume's look)."""
    t = config.train
    every = int(t.local_checkpoint_every or 0)
    run_id = ((record or {}).get("_run") or {}).get(RUN_ID)
    if not every or not run_id:
      return cls()
    if (why := _unsupported()) is not None:
      log.warning("train.local_checkpoint_every=%d is off: %s", every, why)
      return cls()
    where = directory(t, workdir, run_id)
    marker = {"workdir": storage.absolute(workdir), RUN_ID: run_id}
    if resuming:
      if not os.path.isdir(os.path.join(where, "checkpoints")):
        log.warning("no local checkpoints in %s (new hosts?): resuming from the run "
                    "directory's checkpoints", where)
        return cls()
      if (found := _read_marker(where)) != marker:
        log.warning("local checkpoints in %s belong to another run (%s, not %s); not "
                    "restoring them", where, found, marker)
        return cls()
    else:
      os.makedirs(where, exist_ok=True)
      storage.write_text(os.path.join(where, MARKER), json.dumps(marker))
    return cls(every, where, _manager(where, t, resuming))

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps()) if self.manager else []

  def due(self, step: int) -> bool:
    return bool(self.every) and step % self.every == 0

  def restore_newer(self, than: int | None, template, shardings) -> tuple[Any, Any]:
    """The newest local step after `than` (the persistent tier's latest) that restores,
    else (None, None). A local step that fails is deleted (the run directory's
    checkpoints are the record; this is a scratch copy) and the one before it tried."""
    for step in sorted((s for s in self.steps() if than is None or s > than), reverse=True):
      try:
        restored = ckpt.restore_step(self.manager, step, template, shardings)
      except Exception as e:  # pylint: disable=broad-except
        log.warning("local checkpoint %s/%d failed to restore (%s: %s); deleting it",
                    self.directory, step, type(e).__name__, e)
        self._delete_after(step - 1)
        continue
      self.restored = os.path.join(self.directory, "checkpoints", str(step))
      log.warning("local checkpoint %s is newer than the run directory's latest (%s): "
                  "resuming from it", self.restored, than)
      return restored
    return None, None

  def save(self, step: int, state, data_state) -> None:
    """Saves `step`; steps at or after it (a rolled-back or damaged trajectory) go first."""
    self._seal()
    self._delete_after(step - 1)
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(serialization.to_state_dict(state)),
        data=ocp.args.JsonSave(data_state if data_state is not None else {})), force=True)
    if not self.manager.is_saving_in_progress():
      self._seal()

  def drop_after(self, step: int) -> None:
    """Deletes the local steps after `step` (a rollback to it: they are another
    trajectory now)."""
    if self.manager:
      self._seal()
      self._delete_after(step)

  def close(self) -> None:
    if self.manager:
      try:
        self._seal()
      finally:
        self.manager.close()

  def _seal(self) -> None:
    """Waits for a pending save, then writes the checksums of finished unsealed steps
    (never recorded in RUN/checkpoints.jsonl: not a committed save of the run)."""
    self.manager.wait_until_finished()
    where = str(self.manager.directory)
    checksums.seal(where, checksums.unsealed(where, self.manager.all_steps()))

  def _delete_after(self, step: int) -> None:
    for s in self.manager.all_steps():
      if s > step:
        self.manager.delete(s)


def _read_marker(directory: str) -> dict | None:
  try:
    return json.loads(storage.read_text(os.path.join(directory, MARKER)))
  except (OSError, ValueError):
    return None


def _manager(directory: str, train_cfg, resuming: bool) -> ocp.CheckpointManager:
  """The tier's orbax manager; `resuming`: one that creates nothing, keeps every step
  it finds (the saving manager keeps the newest KEEP), and saves synchronously."""
  ckpt._save_replicated_arrays_from_one_device()  # pylint: disable=protected-access
  where = os.path.join(directory, "checkpoints")
  if resuming:
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=False)
  else:
    options = ocp.CheckpointManagerOptions(
        preservation_policy=ocp.checkpoint_managers.LatestN(n=KEEP), create=True, cleanup_tmp_directories=True,
        enable_async_checkpointing=bool(train_cfg.async_checkpoint))
  manager = ocp.CheckpointManager(where, options=options, item_names=("state", "data"))
  if (cleanup := getattr(manager, "_cleanup_tmp_directory_future", None)) is not None:
    cleanup.result()  # As train/checkpoint.py make_manager: never racing the exit.
    manager._cleanup_tmp_directory_future = None  # pylint: disable=protected-access
  return manager

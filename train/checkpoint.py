"""orbax CheckpointManager wiring: sharded state + data-iterator state, with fallbacks.

A checkpoint at step t holds two items: "state" (the TrainState as a state
dict: params, optimizer state, non-trained model state, step, RNG, counters)
and "data" (the grain iterator state, JSON). Every process takes part in
saving and restoring; orbax writes each array shard from its owner.

A latest checkpoint that fails to restore (corrupt, half-written) or whose files
differ from the checksums written when it was saved (train/io/checksums.py) is skipped
with a warning and the previous one is tried. A trainer (which will write new
checkpoints past it) moves it aside to `checkpoints_corrupt/<step>`, never
deleting it; a reader (`load_run`, eval, generate) leaves the directory as it is.

Each committed save is recorded in the run directory, outside `checkpoints/`: a line
`{"step": N, "time": ...}` of `checkpoints.jsonl` (an append-only log, train/io/runlog.py:
one file locally, segments on a bucket), written by process 0 when the save is known to
be finished (`seal`), before its checksums. A run whose checkpoints are all gone is then
told apart from one killed before its first save committed (train/lifecycle/resume.py).

The run directory may be a bucket (`gs://`, `s3://`): train/io/checkpoint_store.py says
how orbax writes there and how a step is marked finished; the checksums and the moving
aside go through train/io/storage.py.
"""

from __future__ import annotations

import ast
import functools
import json
import logging
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import serialization
from orbax.checkpoint._src.metadata import array_metadata_store

from train import spikes
from train.io import checkpoint_store, checksums, runlog, storage
from train.lifecycle import config_record
from train.optim import make_optimizer
from train.spec import RunSpec
from train.state import TrainState, make_state

log = logging.getLogger(__name__)

COMMIT_FILE = "commit_success.txt"  # orbax's marker of a finished step (or item).
SAVES_FILE = "checkpoints.jsonl"  # RUN/checkpoints.jsonl: a line per committed save.


def checkpoint_dir(workdir: str) -> str:
  return storage.join(storage.absolute(workdir), "checkpoints")


@functools.cache
def _save_replicated_arrays_from_one_device() -> None:
  """On XLA:CPU, each replicated array is saved from its first replica (orbax's own
  default on GPU). orbax's replica-parallel saving splits it into a slice per device,
  each an op-by-op `lax.slice` compiled for its shape and device, to spread the
  device-to-host copies; on CPU those copies are memcpys, and the hundreds of compiles
  (per state shape and process) cost far more than the save (docs/PERFORMANCE.md).
  The files are the same arrays in larger chunks; either kind restores. Once per
  process, without orbax's warning that a registered handler is replaced."""
  if jax.default_backend() != "cpu":
    return
  absl_log = logging.getLogger("absl")
  level = absl_log.level
  absl_log.setLevel(logging.ERROR)
  try:
    ocp.type_handlers.register_type_handler(
        jax.Array, ocp.type_handlers.ArrayHandler(
            use_replica_parallel=False, array_metadata_store=array_metadata_store.Store()),
        override=True)
  finally:
    absl_log.setLevel(level)


def make_manager(workdir: str, train_cfg=None, read_only: bool = False
                 ) -> ocp.CheckpointManager:
  """The run's manager. `read_only`: for readers; the directory must exist and is
  never written (no `checkpoints/` created, no keep-N deletions, no tmp cleanup).
  A trainer's manager deletes the unfinished saves of killed attempts (a temporary
  directory; on a bucket, a step without its commit marker) when it opens."""
  _save_replicated_arrays_from_one_device()
  where = checkpoint_store.manager_options(checkpoint_dir(workdir))
  if read_only:
    if not storage.isdir(checkpoint_dir(workdir)):
      raise FileNotFoundError(f"no checkpoint in {checkpoint_dir(workdir)} (the directory "
                              "does not exist): has this run saved one yet?")
    options = ocp.CheckpointManagerOptions(read_only=True, create=False,
                                           enable_async_checkpointing=False, **where)
  else:
    options = ocp.CheckpointManagerOptions(
        preservation_policy=preservation_policy(train_cfg), create=True,
        cleanup_tmp_directories=True,
        enable_async_checkpointing=bool(train_cfg.async_checkpoint), **where)
  manager = ocp.CheckpointManager(checkpoint_dir(workdir), options=options,
                                  item_names=("state", "data"))
  # orbax deletes killed attempts' unfinished saves in a background thread that only a
  # save waits for: one left running when the process exits (a refusal before any save)
  # races the interpreter's shutdown ("cannot schedule new futures after shutdown") and
  # can cost the exit status. Its listing is quick: wait for it here, on every path.
  if (cleanup := getattr(manager, "_cleanup_tmp_directory_future", None)) is not None:
    cleanup.result()
    manager._cleanup_tmp_directory_future = None  # pylint: disable=protected-access
  return manager


def close(manager: ocp.CheckpointManager) -> None:
  """Every trainer's exit: pending saves finish and are sealed, then the manager's
  threads end (also when sealing fails), so none outlives the process's answer."""
  try:
    seal(manager)
  finally:
    manager.close()


def preservation_policy(train_cfg) -> ocp.checkpoint_managers.PreservationPolicy:
  """Keeps the last `train.keep_checkpoints` (at least 1, the one to resume from), plus
  every step divisible by `train.keep_every` (0: none), as orbax's deprecated
  max_to_keep / keep_period did, plus the steps of `train.keep_steps`."""
  policies = ocp.checkpoint_managers
  keep = [policies.LatestN(n=max(int(train_cfg.keep_checkpoints), 1))]
  if int(train_cfg.keep_every) > 0:
    keep.append(policies.EveryNSteps(interval_steps=int(train_cfg.keep_every)))
  if train_cfg.keep_steps:
    keep.append(policies.CustomSteps(steps=[int(s) for s in train_cfg.keep_steps]))
  return policies.AnyPreservationPolicy(policies=keep)


def save(manager: ocp.CheckpointManager, step: int, state: TrainState, data_state: Any,
         force: bool = False) -> None:
  """Starts a (possibly asynchronous) save of state and iterator state at `step`; the
  finished saves before it get their checksums (`seal`)."""
  seal(manager)  # Waits for the previous save, as manager.save would.
  manager.save(step, args=save_args(state, data_state), force=force)
  if not manager.is_saving_in_progress():  # Synchronous: final now.
    seal(manager)


def save_args(state: TrainState, data_state: Any) -> ocp.args.Composite:
  """What `save` asks orbax to write: the state's state dict and the iterator's JSON."""
  return ocp.args.Composite(
      state=ocp.args.StandardSave(serialization.to_state_dict(state)),
      data=ocp.args.JsonSave(data_state if data_state is not None else {}))


def seal(manager: ocp.CheckpointManager) -> None:
  """Waits for pending saves, then records every committed checkpoint not yet sealed
  in RUN/checkpoints.jsonl and writes its checksums (train/io/checksums.py: the store's
  own on a bucket; locally each process's of its own files, so every process calls it).
  The record comes first: a kill between the two records the step again at the next seal."""
  manager.wait_until_finished()
  directory = str(manager.directory)
  steps = checksums.unsealed(directory, manager.all_steps())
  if steps:
    runlog.append(storage.parent(directory), SAVES_FILE,
                  [json.dumps({"step": int(s), "time": time.time()}) + "\n" for s in steps])
  checksums.seal(directory, steps)


def recorded_saves(workdir: str) -> list[int]:
  """The steps RUN/checkpoints.jsonl records as committed saves, in order."""
  return [int(r["step"]) for r in runlog.read_records(workdir, SAVES_FILE) if "step" in r]


def _abstract(state_template: TrainState, shardings: Any) -> Any:
  """ShapeDtypeStructs carrying the target shardings (restore reshards onto them)."""
  with_sharding = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state_template, shardings)
  return serialization.to_state_dict(with_sharding)


# TrainState fields that checkpoints saved before them lack: restored as a fresh state's.
ADDED_FIELDS = {"recent_loss": spikes.empty_history}


def _saved_fields(manager: ocp.CheckpointManager, step: int) -> set[str] | None:
  """The top-level TrainState fields checkpoint `step` holds (orbax's tree metadata);
  None if it cannot be read (the restore then reports what is wrong)."""
  path = storage.join(str(manager.directory), str(step), "state", "_METADATA")
  try:
    keys = json.loads(storage.read_text(path))["tree_metadata"]
    return {ast.literal_eval(k)[0] for k in keys}
  except (OSError, ValueError, KeyError, TypeError, SyntaxError, IndexError):
    return None


def restore_step(manager: ocp.CheckpointManager, step: int, state_template: TrainState,
                 shardings: Any) -> tuple[TrainState, Any]:
  """Checkpoint `step`, verified against its checksums first (CheckpointDamaged)."""
  checksums.verify(str(manager.directory), step)
  target = _abstract(state_template, shardings)
  saved = _saved_fields(manager, step)
  missing = [k for k in ADDED_FIELDS if saved is not None and k not in saved]
  restored = manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore({k: v for k, v in target.items() if k not in missing}),
      data=ocp.args.JsonRestore()))
  fields = dict(restored["state"])
  for k in missing:
    fields[k] = jax.device_put(ADDED_FIELDS[k](), target[k].sharding)
  state = serialization.from_state_dict(state_template, fields)
  return state, (restored["data"] or None)


def restore_latest(manager: ocp.CheckpointManager, workdir: str, state_template: TrainState,
                   shardings: Any, step: int | None = None, move_aside: bool = False
                   ) -> tuple[TrainState | None, Any]:
  """The newest checkpoint that restores (or `step`), or (None, None) if there is none.

  `move_aside`: the trainer's fallback moves a checkpoint that fails to restore to
  checkpoints_corrupt/ (it would otherwise stay "latest" beside the new ones);
  readers only warn.
  """
  steps = sorted(manager.all_steps(), reverse=True)
  if step is not None:
    if step not in steps:
      raise ValueError(f"no checkpoint at step {step} in {checkpoint_dir(workdir)}; "
                       f"available: {sorted(steps)}")
    return restore_step(manager, step, state_template, shardings)
  for s in steps:
    try:
      return restore_step(manager, s, state_template, shardings)
    except Exception as e:  # pylint: disable=broad-except
      log.warning("checkpoint at step %d failed to restore (%s: %s); %s falling back to the "
                  "previous one", s, type(e).__name__, e,
                  "moving it to checkpoints_corrupt/ and" if move_aside else "")
      if move_aside:
        _move_aside(workdir, s)
        manager.reload()
  return None, None


def _move_aside(workdir: str, step: int) -> None:
  """Copies step `step` to checkpoints_corrupt/<step>[.N], then removes it: its commit
  markers first (on a bucket a kill while removing leaves an unfinished step, which
  orbax ignores and cleans up), CHECKSUMS.json last (what remains is found damaged)."""
  if jax.process_index() != 0:
    return
  src = storage.join(checkpoint_dir(workdir), str(step))
  dst_root = storage.join(storage.absolute(workdir), "checkpoints_corrupt")
  dst = storage.join(dst_root, str(step))
  suffix = 0
  while storage.exists(dst):
    suffix += 1
    dst = storage.join(dst_root, f"{step}.{suffix}")
  found = storage.copy_tree(src, dst)
  order = lambda r: 0 if r.endswith(COMMIT_FILE) else 2 if r == checksums.CHECKSUMS_FILE else 1
  for rel in sorted(found, key=order):
    storage.delete(storage.join(src, rel))
  storage.delete(src, recursive=True)  # The emptied local directories.


def save_imported(workdir: str, spec: RunSpec, params: Any, model_state: Any,
                  environment: dict | None = None) -> None:
  """A step-0 run directory from converted weights (e.g. a Hugging Face import).

  Writes config.json and a checkpoint whose state is built as a fresh run's
  (train/state.py's make_state), so that load_run, `--mode generate` and
  training resume all read it like any run. `environment`: config.json's `_run`
  (e.g. where the weights came from; default: this process's environment).
  """

  config_record.write_config(workdir, spec, environment)
  state = make_state(params, model_state, make_optimizer(spec.train, spec.model),
                     int(spec.train.seed))
  manager = make_manager(workdir, spec.train)
  try:
    save(manager, 0, state, None, force=True)
  finally:
    close(manager)

"""The resume policy: what `run` (train/loop.py) starts from in a run directory.

The run directory is a lab notebook: a fresh directory starts at step 0; a
checkpoint is resumed from, after refusing a model whose parameter shapes differ
and a config that differs from config.json in fields that change what the run
computes (unless the change is deliberate, then recorded with its step:
train/lifecycle/changes.py). Logged history without a checkpoint to continue it is
restarted from step 0 when no save ever committed (an attempt killed before its first
checkpoint: RUN/checkpoints.jsonl, train/checkpoint.py, records none), and refused,
never restarted over, when saves committed and are gone or damaged, or when the run
predates that record (its config.json's `_run` lacks `saves_log`). Tested through launch.py in
tests/train/test_rundir.py and tests/train/test_loop.py.
"""

from __future__ import annotations

import dataclasses
import logging

import jax

from model import ModelConfig
from model.transformer import abstract_variables
from parallel import mesh_context
from train import checkpoint as ckpt, local_checkpoint
from train.lifecycle import changes, config_record, session
from train.metrics import REWOUND_FILE, read_metrics
from train import spec as spec_lib
from train.spec import RunSpec

log = logging.getLogger(__name__)


class RunDirError(ValueError):
  """The run directory holds something that training would contradict or overwrite."""


def start_or_resume(config: RunSpec, workdir: str, s: session.Session, manager, allow_config_change: bool):
  """(state, data_state, tokens_seen at the start) to train from, or the state alone
  when the run is already at train.steps. Refuses what would rewrite its history."""
  saved = config_record.read_record(workdir)
  steps = manager.all_steps()
  if steps and saved is None:
    raise RunDirError(f"{workdir} has checkpoints at steps {sorted(steps)} but no config.json: "
                      "the settings they were trained with are unknown. Restore config.json "
                      "or start a new --workdir.")
  local = local_checkpoint.LocalTier.for_run(config, workdir, saved, resuming=True)
  if steps or local.steps():
    check_compatible(saved, s.model_cfg)
  try:
    with mesh_context(s.mesh, s.rules):  # The newest of both tiers that restores.
      state, data_state = local.restore_newer(max(steps, default=None), s.template,
                                              s.shardings)
      if state is None:
        state, data_state = ckpt.restore_latest(manager, workdir, s.template, s.shardings,
                                                move_aside=True)
  finally:
    local.close()
  t = config.train
  if state is None:
    return _start_fresh(config, workdir, s, saved, steps, allow_config_change)
  start = int(state.step)
  changed = changes.config_changes(saved, dict(config.record))
  deliberate = _deliberate_changes(saved, config)
  # At step 0 (an import or conversion) nothing was trained under the old settings.
  if deliberate and not allow_config_change and start > 0:
    raise RunDirError(
        f"{workdir} was trained to step {start} with a different config; resuming would "
        f"make config.json claim settings the run did not have. Changed: "
        f"{changes.describe(deliberate)}. Use the saved config (or a new --workdir), or pass "
        "--allow_config_change to continue with the change recorded at this step.")
  if start >= t.steps:
    return state
  old_tokens = int(saved["data"]["batch_size"]) * int(saved["data"]["seq_len"])
  tokens_seen = changes.tokens_seen_at(workdir, start, old_tokens)
  if jax.process_index() == 0:
    env = changes.environment_changes(saved.get("_run", {}), config_record.environment(config))
    changes.record_changes(workdir, start, changed + env, tokens_seen=tokens_seen)
    # `_run` is the record of how the run started; one from before runs recorded
    # their data gets it now (this checkpoint's tokenizer is checked from here on).
    config_record.write_config(workdir, config, {"data": s.source.info, **_with_run_id(saved)})
  for c in changed:
    log.warning("config change at step %d: %s", start, changes.describe([c]))
  log.info("resuming %s from step %d (checkpoint %s) to %d", workdir, start,
           local.restored or ckpt.checkpoint_dir(workdir), t.steps)
  return state, data_state, tokens_seen


def _start_fresh(config: RunSpec, workdir: str, s: session.Session, saved, steps,
                 allow_config_change: bool):
  """No checkpoint restores: step 0, unless logged history says checkpoints were lost.
  An attempt killed before its first save committed (nothing recorded in
  checkpoints.jsonl) is redone from step 0: its lines move to metrics.rewound.jsonl
  (train/loop.py `_train`); deterministic init and data order make it the same run."""
  logged = [r for r in read_metrics(workdir) if r.get("step", 0) > 0]
  if logged:
    recorded = ckpt.recorded_saves(workdir)
    if steps or recorded or not records_saves(saved):
      raise RunDirError(_no_checkpoint_message(workdir, logged, steps, recorded, saved))
    changed = _deliberate_changes(saved, config)
    if changed and not allow_config_change:
      raise RunDirError(
          f"{workdir} holds an attempt killed before its first checkpoint (metrics.jsonl up "
          f"to step {max(r['step'] for r in logged)}) with a different config; restarting "
          f"it would redo that history under other settings. Changed: "
          f"{changes.describe(changed)}. Use the saved config (or a new --workdir), or pass "
          "--allow_config_change to restart with this one.")
    log.warning("%s: the attempt that logged %d metrics lines up to step %d was killed "
                "before its first checkpoint committed; restarting from step 0 (steps 1-%d "
                "are trained again, those lines moved to %s)", workdir, len(logged),
                max(r["step"] for r in logged), max(r["step"] for r in logged), REWOUND_FILE)
  elif saved is not None:
    log.info("replacing config.json of %s: it never trained a step", workdir)
  log.info("starting %s fresh at step 0 of %d in %s", config.name or "run",
           config.train.steps, workdir)
  state = session.fresh_state(s)
  run_id = _with_run_id(saved)[local_checkpoint.RUN_ID]
  config_record.write_config(workdir, config,
                             {**config_record.environment(config), "data": s.source.info,
                              SAVES_MARK: ckpt.SAVES_FILE, local_checkpoint.RUN_ID: run_id})
  return state, None, 0


def _with_run_id(saved: dict | None) -> dict:
  """config.json's `_run` with the run's identity (train/local_checkpoint.py): kept once
  made (a restart from step 0 is the same run); made for a new run or one predating it."""
  run = dict((saved or {}).get("_run") or {})
  run.setdefault(local_checkpoint.RUN_ID, local_checkpoint.new_run_id())
  return run


# config.json's `_run` field of a run that records its committed saves in SAVES_FILE.
SAVES_MARK = "saves_log"


def records_saves(saved: dict | None) -> bool:
  """Whether the run (config.json's record) logs its committed saves: runs started
  before the log existed do not, and their missing checkpoints stay refused."""
  return bool(saved) and (saved.get("_run") or {}).get(SAVES_MARK) == ckpt.SAVES_FILE


def _deliberate_changes(saved: dict | None, config: RunSpec) -> list[dict]:
  if saved is None:
    return []
  return [c for c in changes.config_changes(saved, dict(config.record))
          if not changes.is_operational(c["field"])
          and c["old"] is not None and c["new"] is not None]


def _no_checkpoint_message(workdir, logged, steps, recorded, saved) -> str:
  last = max(r["step"] for r in logged)
  where = ckpt.checkpoint_dir(workdir)
  if steps:
    why = (f"none of the checkpoints at steps {sorted(steps)} restores (they were moved to "
           f"{workdir}/checkpoints_corrupt/)")
  elif recorded:
    why = (f"{where} holds no checkpoint, although {ckpt.SAVES_FILE} records committed saves "
           f"at steps {sorted(set(recorded))} (deleted or moved?)")
  else:
    why = (f"{where} holds no checkpoint, and the run does not record its committed saves "
           f"(config.json predates {ckpt.SAVES_FILE}), so whether checkpoints were lost "
           "cannot be told")
  return (f"{workdir}/metrics.jsonl records {len(logged)} lines up to step {last}, but {why}. "
          "Training from step 0 here would rewrite that history. Restore the checkpoints to "
          "continue this run, or train from scratch in a new --workdir.")


def check_compatible(saved: dict, current: ModelConfig) -> None:
  """Refuses to resume when the model's parameter shapes (of `saved`, config.json's
  record) would differ."""
  old = spec_lib.model_config(saved)
  shapes = lambda cfg: jax.tree.map(lambda x: x.shape, abstract_variables(cfg))
  if shapes(old) != shapes(current):
    diff = [f"{f.name}: checkpoint {getattr(old, f.name)!r} vs config {getattr(current, f.name)!r}"
            for f in dataclasses.fields(ModelConfig)
            if getattr(old, f.name) != getattr(current, f.name)]
    raise ValueError("the config's model shape differs from the checkpoint's; refusing to "
                     "resume. Differing fields: " + "; ".join(diff))


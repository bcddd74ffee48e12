"""The resume policy: what `run` (train/loop.py) starts from in a run directory.

The run directory is a lab notebook: a fresh directory starts at step 0; a
checkpoint is resumed from, after refusing a model whose parameter shapes differ
and a config that differs from config.json in fields that change what the run
computes (unless the change is deliberate, then recorded with its step:
train/lifecycle/changes.py); logged history without a checkpoint to continue it is
refused, never restarted over. Tested through launch.py in
tests/train/test_rundir.py and tests/train/test_loop.py.
"""

from __future__ import annotations

import dataclasses
import logging

import jax

from model import ModelConfig
from model.transformer import abstract_variables
from parallel import mesh_context
from train import checkpoint as ckpt
from train.lifecycle import changes, config_record, session
from train.metrics import read_metrics
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
  if steps:
    check_compatible(saved, s.model_cfg)
  with mesh_context(s.mesh, s.rules):
    state, data_state = ckpt.restore_latest(manager, workdir, s.template, s.shardings,
                                            move_aside=True)
  t = config.train
  if state is None:
    logged = [r for r in read_metrics(workdir) if r.get("step", 0) > 0]
    if logged:
      raise RunDirError(_no_checkpoint_message(workdir, logged, steps))
    if saved is not None:
      log.info("replacing config.json of %s: it never trained a step", workdir)
    log.info("starting %s fresh at step 0 of %d in %s", config.name or "run", t.steps,
             workdir)
    state = session.fresh_state(s)
    config_record.write_config(workdir, config,
                               {**config_record.environment(config), "data": s.source.info})
    return state, None, 0
  start = int(state.step)
  changed = changes.config_changes(saved, dict(config.record))
  deliberate = [c for c in changed if not changes.is_operational(c["field"])
                and c["old"] is not None and c["new"] is not None]
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
    config_record.write_config(workdir, config,
                               {"data": s.source.info, **(saved.get("_run") or {})})
  for c in changed:
    log.warning("config change at step %d: %s", start, changes.describe([c]))
  log.info("resuming %s from step %d (checkpoint %s) to %d", workdir, start,
           ckpt.checkpoint_dir(workdir), t.steps)
  return state, data_state, tokens_seen


def _no_checkpoint_message(workdir, logged, steps) -> str:
  last = max(r["step"] for r in logged)
  if not steps:
    why = f"{ckpt.checkpoint_dir(workdir)} holds no checkpoint"
  else:
    why = (f"none of the checkpoints at steps {sorted(steps)} restores (they were moved to "
           f"{workdir}/checkpoints_corrupt/)")
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


"""load_run(workdir): one call to open a finished or running run for analysis."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import ml_collections

from model import ModelConfig
from train import checkpoint as ckpt
from train.data.mqar import MQARTokenizer
from train.data.tokenizers import load_tokenizer
from train.eval.mode import read_evals
from train.lifecycle import changes, config_record, goodput, session
from train.metrics import read_metrics
from train.optimizers import model_params


@dataclasses.dataclass
class Run:
  workdir: str
  config: ml_collections.ConfigDict
  model_config: ModelConfig
  variables: dict[str, Any]  # {"params": ..., **non-trained collections}
  tokenizer: Any
  metrics: list[dict]
  step: int
  # Deliberate config changes on resume, in order: {step, field, old, new, time, ...}
  # (config.json holds the config as of the last resume).
  config_changes: list[dict] = dataclasses.field(default_factory=list)
  evals: list[dict] = dataclasses.field(default_factory=list)  # `--mode eval` records.
  # Where the training attempts' wall time went (train/lifecycle/goodput.py); None: no ledger.
  goodput: goodput.Goodput | None = None


def load_run(workdir: str, step: int | None = None) -> Run:
  """The run's config, tokenizer, metrics and the variables of checkpoint `step`
  (the latest that restores when None), on this process's first device.

  Reading never changes the run: no directory is created, a checkpoint that fails
  to restore is skipped with a warning (not moved), no tokenizer is cached.
  """
  spec = config_record.read_spec(workdir)
  config, model_cfg = spec.config(), spec.model
  s = session.open_run(spec, workdir, "read", devices=jax.local_devices()[:1])
  manager = ckpt.make_manager(workdir, read_only=True)
  try:
    state, _ = ckpt.restore_latest(manager, workdir, s.template, s.shardings, step=step)
  finally:
    manager.close()
  if state is None:
    raise FileNotFoundError(f"no checkpoint in {ckpt.checkpoint_dir(workdir)}")
  if spec.data.corpus == "mqar":
    tokenizer = MQARTokenizer(int(spec.data.mqar_vocab))
  else:
    tokenizer = load_tokenizer(spec.data, workdir, cache=False)
  return Run(workdir=workdir, config=config, model_config=model_cfg,
             variables={"params": model_params(state), **state.model_state}, tokenizer=tokenizer,
             metrics=read_metrics(workdir), step=int(state.step),
             config_changes=changes.read_changes(workdir), evals=read_evals(workdir),
             goodput=goodput.summary(workdir))

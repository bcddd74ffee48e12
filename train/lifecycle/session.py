"""What training and evaluating a run both build from its config: the mesh, this
host's data, and the train state's layout (abstract shapes and shardings)."""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable

import jax

from model import ModelConfig
from parallel import (abstract_shardings, batch_sharding, host_batch_slice, logical_rules,
                      make_mesh, sharded_init)
from train.data.packing import num_windows
from train.data.pipeline import make_source
from train.data.source import Source
from train.data.tokenizers import fingerprint
from train.eval.corpora import describe
from train.lifecycle import config_record
from train.optim import make_optimizer
from train.state import init_state
from train.validation import validate

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Session:
  model_cfg: ModelConfig
  mesh: jax.sharding.Mesh
  rules: Any
  batch_sharding: jax.sharding.NamedSharding
  source: Source  # train/data/token_source.py DataSource or train/data/mqar.py MQARSource.
  optimizer: Any
  init_fn: Callable[[], Any]  # A fresh TrainState with boxed (logically named) leaves.
  shardings: Any  # NamedShardings of the unboxed TrainState.
  template: Any  # The unboxed abstract TrainState (restore target).


@dataclasses.dataclass
class Layout:
  """The train state's layout on a mesh, without data: what an ahead-of-time compile
  (train/aot/) needs, and what `build` adds a data source to."""
  model_cfg: ModelConfig
  mesh: jax.sharding.Mesh
  rules: Any
  batch_sharding: jax.sharding.NamedSharding
  optimizer: Any
  init_fn: Callable[[], Any]
  shardings: Any
  template: Any


def layout(config, model_cfg: ModelConfig, devices=None) -> Layout:
  """Mesh (over `devices`, default: all), rules, batch sharding and the state's shardings."""
  mesh = make_mesh(config.mesh, devices)
  rules = logical_rules(mesh=mesh, num_kv_heads=model_cfg.num_kv_heads,
                        num_heads=model_cfg.num_heads)
  optimizer = make_optimizer(config.train, model_cfg)
  init_fn = functools.partial(init_state, model_cfg, optimizer, int(config.train.seed),
                              int(config.data.seq_len))
  template, shardings = abstract_shardings(init_fn, mesh=mesh, rules=rules)
  return Layout(model_cfg=model_cfg, mesh=mesh, rules=rules,
                batch_sharding=batch_sharding(mesh, rules), optimizer=optimizer,
                init_fn=init_fn, shardings=shardings, template=template)


def build(config, workdir: str, read_only: bool = False) -> Session:
  """Validates `config` (before anything compiles) and lays out the run on the devices.

  `read_only`: the data source never writes to `workdir` (a reader's session).
  """
  model_cfg = validate(config, jax.device_count())
  d = config.data
  lay = layout(config, model_cfg)
  # The pipeline reads the rows this process's devices hold: processes that differ
  # only along non-batch axes (tensor across hosts) read the same rows.
  rows = host_batch_slice(lay.batch_sharding, d.batch_size)
  rows_per_shard = rows.stop - rows.start
  expect = recorded_data(workdir).get("tokenizer_fingerprint")
  source = make_source(d, workdir, rows.start // rows_per_shard,
                       d.batch_size // rows_per_shard, read_only=read_only,
                       expect_tokenizer=expect)
  # Every source's tokenizer (a prepared dataset's, a mixture's too) is the recorded one.
  source.info["tokenizer_fingerprint"] = fingerprint(source.tokenizer)
  if expect and source.info["tokenizer_fingerprint"] != expect:
    raise ValueError(f"config.data.corpus={d.corpus!r}: its tokenizer "
                     f"({source.info['tokenizer_fingerprint']}) is not the one the run in "
                     f"{workdir} was trained with ({expect}, in its config.json)")
  if source.tokenizer.vocab_size > model_cfg.vocab_size:
    raise ValueError(f"config.model.vocab_size={model_cfg.vocab_size} is smaller than the "
                     f"tokenizer's vocabulary ({source.tokenizer.vocab_size})")
  _check_size(source, config)
  # What stands behind every bpb/<name> (issue 37): recorded with the run's data.
  source.info["eval_corpora"] = describe(config, source)
  return Session(model_cfg=model_cfg, mesh=lay.mesh, rules=lay.rules,
                 batch_sharding=lay.batch_sharding, source=source, optimizer=lay.optimizer,
                 init_fn=lay.init_fn, shardings=lay.shardings, template=lay.template)


def fresh_state(s: Session) -> Any:
  """A step-0 TrainState, each device computing only its own shard."""
  state, _ = sharded_init(s.init_fn, mesh=s.mesh, rules=s.rules, shardings=s.shardings)
  return state


def recorded_data(workdir: str | None) -> dict:
  """config.json's `_run.data`: what the run was trained on ({} for a new run, or one
  recorded before runs recorded it)."""
  record = config_record.read_record(workdir) if workdir else None
  data = ((record or {}).get("_run") or {}).get("data")
  return data if isinstance(data, dict) else {}


def _check_size(source, config) -> None:
  """A split without one window is refused, naming data.corpus, before anything is
  written; a corpus smaller than one batch trains on repeated windows: legal, but said."""
  if not hasattr(source, "train"):  # Synthetic (MQAR): every window is new.
    return
  d, ev = config.data, config.eval
  longest = max(int(m * d.seq_len) for m in (*ev.context_lengths, 1))
  for split, stream, length in (("train", source.train, int(d.seq_len)),
                                ("validation", source.val, longest)):
    if num_windows(len(stream), length) < 1:
      raise ValueError(
          f"config.data.corpus={d.corpus!r}: the {split} split has {len(stream)} tokens "
          f"after tokenization, too few for one window of {length} (needs at least 2 "
          f"tokens; {source.info.get('files', '?')} files read): give the corpus more "
          "text (empty files count as nothing)")
  train_windows = num_windows(len(source.train), int(d.seq_len))
  if train_windows < int(d.batch_size):
    log.warning("the train split has %d tokens, %d windows of data.seq_len=%d: fewer than "
                "one batch (data.batch_size=%d), so every batch repeats windows",
                len(source.train), train_windows, d.seq_len, d.batch_size)
  val_windows = num_windows(len(source.val), longest)
  if val_windows < int(ev.batch_size):
    log.warning("the validation split has %d tokens, %d windows of %d: fewer than one eval "
                "batch (eval.batch_size=%d), so eval batches repeat windows",
                len(source.val), val_windows, longest, ev.batch_size)

"""The one opener of a run directory for every mode: `open_run(spec, workdir, mode)`.

From the parsed spec (train/spec) it lays out the run on the devices (mesh, rules, batch
sharding, optimizer, the train state's abstract shapes and shardings) and, as the mode
needs, holds the run's LOCK (train/lifecycle/lock.py: one writer) and opens this host's
data, with the tokenizer resolved and checked against the run's record once
(train/data/tokenizers.py require_tokenizer).

    with open_run(spec, workdir, "train") as s:    # the LOCK is held until the block ends
      state = fresh_state(s)

  train     loop.run                    LOCK, data (may cache a tokenizer in the run)
  eval      --mode eval (eval_run)      data, read-only
  compile   --mode compile (train/aot)  layout on a topology's devices; no run directory
  read      load_run: generate, export, convert's source; one device
  branch    a decay branch's new run    LOCK while its checkpoint and record are written
  convert   --mode convert's new run    LOCK while its checkpoint and record are written
"""

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
from train.eval.corpora import describe
from train.lifecycle import config_record
from train.lifecycle.lock import WorkdirLock
from train.optim import make_optimizer
from train.spec import MeshSpec, RunSpec, parse
from train.state import init_state

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Mode:
  lock: bool  # The one writer of the run directory holds its LOCK.
  data: bool  # This host's data source is opened.
  writes: bool  # The data source may write into the run (its tokenizer cache).


MODES = {"train": Mode(lock=True, data=True, writes=True),
         "eval": Mode(lock=False, data=True, writes=False),
         "compile": Mode(lock=False, data=False, writes=False),
         "read": Mode(lock=False, data=False, writes=False),
         "branch": Mode(lock=True, data=False, writes=False),
         "convert": Mode(lock=True, data=False, writes=False)}


@dataclasses.dataclass
class Session:
  """An opened run: its spec, its layout on the devices and, by mode, its data and LOCK.
  A context manager: leaving it releases the LOCK (train)."""
  spec: RunSpec
  mesh: jax.sharding.Mesh
  rules: Any
  batch_sharding: jax.sharding.NamedSharding
  optimizer: Any
  init_fn: Callable[[], Any]  # A fresh TrainState with boxed (logically named) leaves.
  shardings: Any  # NamedShardings of the unboxed TrainState.
  template: Any  # The unboxed abstract TrainState (restore target).
  # train/data/token_source.py DataSource, train/data/mqar.py MQARSource, ...; None
  # when the mode reads no data.
  source: Source | None = None
  lock: WorkdirLock | None = None

  @property
  def model_cfg(self) -> ModelConfig:
    return self.spec.model

  def close(self) -> None:
    if self.lock is not None:
      self.lock.release()
      self.lock = None

  def __enter__(self) -> "Session":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def open_run(spec: RunSpec | Any, workdir: str | None, mode: str,
             devices: list | None = None) -> Session:
  """Opens `workdir` for `mode` (MODES) from `spec` (a ConfigDict is parsed here, a
  RunSpec handed on unparsed) on `devices` (default: all)."""
  how = MODES[mode]
  spec = parse(spec, None if devices is not None else jax.device_count())
  lock = (WorkdirLock(workdir, enabled=jax.process_index() == 0,
                      lease_s=spec.train.lock_lease_s) if how.lock else None)
  if lock is not None:
    lock.acquire()
  try:
    s = _layout(spec, devices, mode)
    if how.data:
      s.source = _open_data(spec, workdir, s.batch_sharding, read_only=not how.writes)
  except BaseException:
    if lock is not None:
      lock.release()
    raise
  s.lock = lock
  return s


def _layout(spec: RunSpec, devices, mode: str) -> Session:
  """Mesh (over `devices`, default: all), rules, batch sharding and the state's shardings.
  A reader ("read") lays the run out on its devices whatever mesh it trained on."""
  model_cfg = spec.model
  mesh = make_mesh((MeshSpec() if mode == "read" else spec.mesh).sizes(), devices)
  rules = logical_rules(mesh=mesh, num_kv_heads=model_cfg.num_kv_heads,
                        num_heads=model_cfg.num_heads)
  optimizer = make_optimizer(spec.train, model_cfg)
  init_fn = functools.partial(init_state, model_cfg, optimizer, int(spec.train.seed),
                              int(spec.data.seq_len))
  template, shardings = abstract_shardings(init_fn, mesh=mesh, rules=rules)
  return Session(spec=spec, mesh=mesh, rules=rules, batch_sharding=batch_sharding(mesh, rules),
                 optimizer=optimizer, init_fn=init_fn, shardings=shardings,
                 template=template)


def _open_data(spec: RunSpec, workdir: str, batch: jax.sharding.NamedSharding,
               read_only: bool) -> Source:
  """This host's rows of the run's data; its tokenizer must be the one the run recorded."""
  d = spec.data
  # The pipeline reads the rows this process's devices hold: processes that differ
  # only along non-batch axes (tensor across hosts) read the same rows.
  rows = host_batch_slice(batch, d.batch_size)
  rows_per_shard = rows.stop - rows.start
  # Every source's tokenizer (a prepared dataset's, a mixture's too) must be the recorded
  # one: make_source refuses another (train/data/tokenizers.py require_tokenizer).
  source = make_source(d, workdir, rows.start // rows_per_shard,
                       d.batch_size // rows_per_shard, read_only=read_only,
                       expect_tokenizer=recorded_data(workdir).get("tokenizer_fingerprint"))
  if source.tokenizer.vocab_size > spec.model.vocab_size:
    raise ValueError(f"config.model.vocab_size={spec.model.vocab_size} is smaller than the "
                     f"tokenizer's vocabulary ({source.tokenizer.vocab_size})")
  _check_size(source, spec)
  # What stands behind every bpb/<name> (issue 37): recorded with the run's data.
  source.info["eval_corpora"] = describe(spec, source)
  return source


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

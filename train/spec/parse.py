"""ConfigDict (or an older run's config.json) -> RunSpec: the one reader of raw config.

`parse(config, num_devices)` is what a run starts from: it copies `config` (never
changes it), fills the fields an older run's config.json lacks (sections.ABSENT, else
the defaults), resolves what is derived (model.vocab_size from the tokenizer), runs every
check once (train/spec/checks.py: the first error names the field, its value and what it
must be) and builds the ModelConfig. `read(config)` does the same without the checks:
how a finished run's record is opened (load_run, eval, resume's comparison).

    spec = parse(config, jax.device_count())
    spec.model          # ModelConfig (frozen; the only one built from a config)
    spec.train.lr       # TrainSpec, DataSpec, EvalSpec, MeshSpec, HardwareSpec fields
    spec.record         # what config.json records (the resolved config, as a dict)
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

import ml_collections

from model import ModelConfig
from train.spec import checks
from train.spec.sections import (ABSENT, SECTIONS, DataSpec, EvalSpec, HardwareSpec,
                                 MeshSpec, TrainSpec, defaults)


@dataclasses.dataclass(frozen=True, eq=False)
class RunSpec:
  """One run's settings, typed and checked; what every mode starts from."""
  name: str
  model: ModelConfig
  data: DataSpec
  train: TrainSpec
  eval: EvalSpec
  mesh: MeshSpec
  hardware: HardwareSpec
  record: Mapping[str, Any]  # The resolved config as config.json records it (no `_run`).

  def config(self) -> ml_collections.ConfigDict:
    """The resolved config as a fresh ConfigDict (for a mode that derives another run's
    config from this one: a branch, a conversion, a sweep point)."""
    return ml_collections.ConfigDict(copy.deepcopy(dict(self.record)))


def derived_vocab_size(data: Any) -> int:
  """The vocabulary the tokenizer of `data` (a DataSpec, a data section, or config.json's
  dict of it) has: model.vocab_size when it is unset."""
  if isinstance(data, Mapping) and not isinstance(data, ml_collections.ConfigDict):
    data = _section(DataSpec, {**defaults("data"), **data})
  if data.corpus == "mqar":
    return int(data.mqar_vocab)
  if data.tokenizer == "byte":
    return 256
  return int(data.vocab_size)  # SentencePiece's size, or the HF file's (load checks).


def _filled(config: Any) -> ml_collections.ConfigDict:
  """A copy of `config` (a ConfigDict or config.json's dict) with every section field
  present (an older run's absent ones at what they meant then) and model.vocab_size
  resolved; `_run` dropped."""
  raw = config.to_dict() if isinstance(config, ml_collections.ConfigDict) else dict(config)
  raw = copy.deepcopy({k: v for k, v in raw.items() if k != "_run"})
  for section, kind in SECTIONS.items():
    have = raw.setdefault(section, {})
    for f in dataclasses.fields(kind):
      if f.name not in have:
        have[f.name] = ABSENT.get((section, f.name), f.default)
  out = ml_collections.ConfigDict(raw)
  if out.model.get("vocab_size") is None:  # The one place that resolves it.
    with out.unlocked():
      out.model.vocab_size = derived_vocab_size(out.data)
  return out


def _section(kind, values: Mapping[str, Any]):
  """A frozen section from a filled dict: lists (config.json's tuples) back to tuples."""
  fields = {}
  for f in dataclasses.fields(kind):
    v = values[f.name]
    fields[f.name] = tuple(v) if isinstance(v, list) else v
  return kind(**fields)


def _spec(filled: ml_collections.ConfigDict, model: ModelConfig) -> RunSpec:
  record = filled.to_dict()
  sections = {name: _section(kind, record[name]) for name, kind in SECTIONS.items()}
  return RunSpec(name=str(record.get("name") or ""), model=model, record=record, **sections)


def _model(filled: ml_collections.ConfigDict) -> ModelConfig:
  """The experiment config's model section as the frozen ModelConfig, which validates its
  own fields: the one place a ModelConfig is built from a config."""
  return ModelConfig.from_dict(filled.model.to_dict())


def read(config: Any) -> RunSpec:
  """The spec of `config` (a ConfigDict, or a run's config.json as a dict) without the
  checks: an existing run's record, opened to read or compare."""
  filled = _filled(config)
  return _spec(filled, _model(filled))


def parse(config: Any, num_devices: int | None) -> RunSpec:
  """Every check, once, then the spec; `num_devices` sizes the mesh checked (None: the
  caller checks its own mesh, as an ahead-of-time compile for a topology does)."""
  if isinstance(config, RunSpec):
    return config  # Parsed already: a run's modes hand the spec on, never parse twice.
  filled = _filled(config)
  checks.check_sections(filled)
  model = _model(filled)
  checks.check_against_model(filled, model, num_devices)
  return _spec(filled, model)


def model_config(config: Any) -> ModelConfig:
  """`read(config).model`: the ModelConfig of a config or a run's record."""
  return config.model if isinstance(config, RunSpec) else read(config).model

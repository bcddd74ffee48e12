"""The typed run spec: a config (ml_collections, the user-facing format) read once into
frozen dataclasses, checked once, its derived fields resolved, never mutating its input.

    from train.spec import parse
    spec = parse(config, jax.device_count())   # RunSpec: model, data, train, eval, mesh
    spec.model.num_kv_heads, spec.train.lr, spec.record   # config.json's content

  sections.py  the fields of each section: types, defaults (base.py's), what they mean
  checks.py    every check, each error naming the field, its value and what it must be
  parse.py     ConfigDict / config.json -> RunSpec (`parse` checks, `read` does not)

A new config field: declare it in sections.py (type, default, a comment), check it in
checks.py if it can be wrong, read it as `spec.<section>.<field>` where it is used.
"""

from train.spec.parse import RunSpec, derived_vocab_size, model_config, parse, read
from train.spec.sections import (ABSENT, DataSpec, EvalSpec, HardwareSpec, MeshSpec,
                                 TrainSpec, defaults)

__all__ = ["ABSENT", "DataSpec", "EvalSpec", "HardwareSpec", "MeshSpec", "RunSpec",
           "TrainSpec", "defaults", "derived_vocab_size", "model_config", "parse", "read"]

"""The full experiment config, with documented defaults; others derive from it.

`get_config(arg)` takes big_vision-style variant arguments, e.g.
`experiments/configs/base.py:size=small,smoke`:
  size=tiny|small|medium   model width/depth preset
  smoke                    shrink everything to a seconds-long run (tests, CI)

Arguments are declared, with their defaults (which give their types), once per
config: base's in `ARGS`; a derived config parses its own plus base's and hands
the result on, so a misspelt or unknown argument is an error, never ignored:

  def get_config(arg=None):
    a = base.parse_arg(arg, **base.ARGS, seeds=3)
    c = base.get_config(a)
"""

from __future__ import annotations

import dataclasses

import ml_collections
from ml_collections import config_dict

from experiments.configs.sizes import SIZES, smoke_fields
from model.config import ModelConfig
from train.spec import defaults as spec_defaults

# base's own arguments and their defaults; derived configs add theirs (see above).
ARGS = {"size": "tiny", "smoke": False}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
  """Parses "a=1,b=x,smoke" against the declared `defaults` into a ConfigDict.

  Each value takes its default's type; a bare word sets a boolean to True. An
  undeclared key (`seed=2` for `seeds`), a repeated one or a value that does not
  parse (`smoke=flase`) raises ValueError naming it: a typo must not silently run
  a different experiment.
  """
  out = ml_collections.ConfigDict(defaults)
  seen = set()
  for item in filter(None, (i.strip() for i in (arg or "").split(","))):
    key, has_value, value = (s.strip() for s in item.partition("="))
    if key not in defaults:
      raise ValueError(f"config argument {key!r} (in {arg!r}) is not one of this config's "
                       f"arguments: {', '.join(sorted(defaults))}")
    if key in seen:
      raise ValueError(f"config argument {key!r} is given twice in {arg!r}")
    seen.add(key)
    out[key] = _parse_value(key, value if has_value else None, defaults[key])
  return out


def plus_list(a: ml_collections.ConfigDict, key: str, kind=float) -> list:
  """The '+'-separated values of argument `key` ("1e-3+3e-3"), each as `kind`; a value
  that does not parse raises ValueError naming the argument."""
  try:
    return [kind(v) for v in str(a[key]).split("+") if v]
  except ValueError:
    raise ValueError(f"config argument {key}={a[key]!r}: expected '+'-separated "
                     f"{kind.__name__} values") from None


def _parse_value(key: str, value: str | None, default):
  """`value` as the type of `default`; None: the bare word `key`."""
  if isinstance(default, bool):
    if value is None or value.lower() in _TRUE:
      return True
    if value.lower() in _FALSE:
      return False
    raise ValueError(f"config argument {key}={value!r}: expected a boolean "
                     f"({'/'.join(_TRUE)} or {'/'.join(_FALSE)}), or the bare word {key}")
  if value is None:
    raise ValueError(f"config argument {key!r} needs a value: {key}=... (default {default!r})")
  for kind in (int, float):
    if isinstance(default, kind):
      try:
        return kind(value)
      except ValueError:
        raise ValueError(f"config argument {key}={value!r}: expected {kind.__name__}, "
                         f"like the default {default!r}") from None
  return value


def model_defaults() -> dict:
  """ModelConfig's own defaults for every field, so config.model is complete."""
  out = {}
  for f in dataclasses.fields(ModelConfig):
    if f.default is dataclasses.MISSING:
      out[f.name] = None
    elif f.default is None:  # Typed placeholder, so command-line overrides parse.
      kind = float if "float" in str(f.type) else int
      out[f.name] = config_dict.placeholder(kind)
    else:
      out[f.name] = f.default
  return out


def train_defaults() -> ml_collections.ConfigDict:
  """config.train: optimisation, logging, checkpointing, failure handling, profiling
  (each field: train/spec/sections.py TrainSpec)."""
  return ml_collections.ConfigDict(spec_defaults("train"))


def get_config(arg: str | ml_collections.ConfigDict | None = None
               ) -> ml_collections.ConfigDict:
  """The base experiment; `arg` is the string, or a derived config's parse_arg result
  (which declared base's ARGS too; only those are read here)."""
  try:
    a = arg if isinstance(arg, ml_collections.ConfigDict) else parse_arg(arg, **ARGS)
  except ValueError as e:  # The likely cause, for whoever writes a derived config.
    raise ValueError(f"{e} (a derived config declares its own arguments: "
                     "base.get_config(base.parse_arg(arg, **base.ARGS, its=defaults)))") from None
  c = ml_collections.ConfigDict()
  c.name = "base"
  c.model = model_section(a.size)
  c.data = data_defaults()
  c.train = train_defaults()
  c.eval = eval_defaults()
  c.mesh = mesh_defaults()
  c.hardware = ml_collections.ConfigDict(spec_defaults("hardware"))
  if a.smoke:
    apply_smoke(c)
  return c


def model_section(size: str) -> ml_collections.ConfigDict:
  """config.model: every ModelConfig field, at the `size` preset; None-valued fields
  are placeholders so that `--config.model.head_dim=64` works from the command line."""
  if size not in SIZES:
    raise ValueError(f"size={size!r}: must be one of {sorted(SIZES)}")
  m = ml_collections.ConfigDict(model_defaults())
  # vocab_size None: the tokenizer's (train/spec/parse.py derived_vocab_size); set it
  # only to pad the embedding beyond the tokenizer (e.g. to a multiple of 128).
  m.update(max_seq_len=256, **SIZES[size])
  m.vocab_size = config_dict.placeholder(int)
  return m


def data_defaults() -> ml_collections.ConfigDict:
  """config.data: corpus, tokenizer, batch shape, validation split, MQAR task (each
  field: train/spec/sections.py DataSpec)."""
  return ml_collections.ConfigDict(spec_defaults("data"))


def eval_defaults() -> ml_collections.ConfigDict:
  """config.eval: batches, context lengths, zero-shot RoPE scaling, extra corpora and
  tasks (each field: train/spec/sections.py EvalSpec; docs/evaluation.md)."""
  return ml_collections.ConfigDict(spec_defaults("eval"))


def mesh_defaults() -> ml_collections.ConfigDict:
  """config.mesh: device mesh axis sizes (train/spec/sections.py MeshSpec; docs/scaling.md,
  "The mesh")."""
  return ml_collections.ConfigDict(spec_defaults("mesh"))


# The text ablations' CPU preset (`cpu`: gqa_ablation, rope_ablation, moe_ablation): a
# whole 3-seed sweep in under 30 minutes on 2 cores, at which GQA's and the positional
# encodings' differences exceed the seeds' noise (MoE's: its balance, not its loss);
# measured in docs/ablations.md, "On a CPU".
CPU_MODEL = dict(d_model=64, num_layers=2, num_heads=4, num_kv_heads=4, mlp_dim=256)


def apply_cpu(c: ml_collections.ConfigDict, a: ml_collections.ConfigDict) -> None:
  """The CPU preset on `c` (parsed arguments `a`; refused beside smoke or a size)."""
  if a.smoke or a.size != ARGS["size"]:
    raise ValueError(f"config argument cpu: a preset of its own, not to be combined with "
                     f"{'smoke' if a.smoke else f'size={a.size}'}")
  c.model.update(CPU_MODEL)
  c.data.update(seq_len=64, batch_size=16)
  c.train.update(steps=800, warmup_steps=40, log_every=100, eval_every=400,
                 checkpoint_every=400)
  c.eval.update(batches=16, batch_size=16)


def apply_smoke(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Shrinks any config to a seconds-long run with the same structure."""
  c.model.update(smoke_fields(c.model, max_seq_len=64, max_experts=4))
  c.data.seq_len = 32
  c.data.batch_size = 8
  c.train.steps = 10
  c.train.warmup_steps = 2
  c.train.log_every = 5
  c.train.eval_every = 10
  c.train.checkpoint_every = 10
  c.eval.batches = 2
  c.eval.batch_size = 8
  return c

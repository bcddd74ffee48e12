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
from train.eval import tasks as eval_tasks

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
  """config.train: optimisation, logging, checkpointing, failure handling, profiling."""
  t = ml_collections.ConfigDict()
  t.steps = 600
  t.seed = 0
  t.lr = 3e-3
  t.schedule = "cosine"  # "cosine" | "linear" | "constant" | "wsd" (warmup-stable-decay)
  t.warmup_steps = 50
  t.min_lr_ratio = 0.1
  # wsd: the cooldown's share of train.steps and its shape, "linear" or "sqrt" (1 - sqrt).
  t.decay_fraction = 0.2
  t.decay_shape = "linear"
  t.b1 = 0.9
  t.b2 = 0.95
  t.eps = 1e-8
  t.weight_decay = 0.1
  t.decay_norms = False  # Weight decay on norm scales.
  t.decay_biases = False
  t.decay_embeddings = False
  t.grad_clip = 1.0  # Global-norm clip; 0: off.
  t.grad_accum = 1  # Micro-batches per optimizer step.
  # PaLM's output z-loss: + z_loss * mean(log² Z) (PaLM used 1e-4); 0: off.
  t.z_loss = 0.0
  # Per-layer stability telemetry in every step (train/telemetry.py, docs/stability.md).
  t.telemetry = True
  t.log_every = 20
  t.eval_every = 200
  t.checkpoint_every = 200
  t.keep_checkpoints = 3  # Keep the last N...
  t.keep_every = 0  # ...plus every K-th step (0: none)...
  t.keep_steps = ()  # ...plus these (decay branches start there).
  t.async_checkpoint = True
  t.on_nonfinite = "stop"  # "stop" | "skip" (skip the update, count it)
  # Loss spikes (train/spikes.py, docs/stability.md): a step whose loss exceeds
  # spike_threshold x the median of the spike_window steps before it (0: off);
  # on_spike "none" (log it) | "skip_batch" (drop its update) | "rollback" (restore the last
  # checkpoint, skip the data since it).
  t.spike_threshold = 1.5
  t.spike_window = 50
  t.on_spike = "none"
  t.tensorboard = True
  # Weights & Biases project ("": off); needs `pip install -e .[wandb]`. WANDB_MODE=offline
  # logs into RUN/wandb/ without network. A resume continues the same W&B run.
  t.wandb_project = ""
  # jax.profiler trace of profile_steps steps (0: off) from step profile_start (0: the
  # first step after compilation) into RUN/profile/ (TensorBoard's profile plugin, Perfetto).
  t.profile_steps = 0
  t.profile_start = 0
  return t


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
  c.hardware = ml_collections.ConfigDict()
  c.hardware.peak_flops = 0.0  # Per device; 0: measure a jitted matmul at startup.
  if a.smoke:
    apply_smoke(c)
  return c


def model_section(size: str) -> ml_collections.ConfigDict:
  """config.model: every ModelConfig field, at the `size` preset; None-valued fields
  are placeholders so that `--config.model.head_dim=64` works from the command line."""
  if size not in SIZES:
    raise ValueError(f"size={size!r}: must be one of {sorted(SIZES)}")
  m = ml_collections.ConfigDict(model_defaults())
  # vocab_size None: the tokenizer's (train/validation.py derived_vocab_size); set it
  # only to pad the embedding beyond the tokenizer (e.g. to a multiple of 128).
  m.update(max_seq_len=256, **SIZES[size])
  m.vocab_size = config_dict.placeholder(int)
  return m


def data_defaults() -> ml_collections.ConfigDict:
  """config.data: corpus, tokenizer, batch shape, validation split, MQAR task."""
  d = ml_collections.ConfigDict()
  # "shakespeare" | dir or glob of .txt | *.bin tokens | "mqar" | a prepared dataset
  # (`--mode prepare`'s output: a directory, or a gs:// / s3:// URL) | "mixture".
  d.corpus = "shakespeare"
  # Named prepared datasets, "web=prepared/web,code=gs://bucket/code": what data.mixture
  # (and eval.corpora) name.
  d.datasets = ""
  # corpus="mixture": weights over data.datasets, "web:0.7,code:0.3" (any positive scale).
  d.mixture = ""
  d.token_dtype = "uint16"  # For pre-tokenized .bin corpora.
  # "byte" | "sentencepiece" | "hf:PATH" (a tokenizer.json) | "hf" (the run's own copy).
  d.tokenizer = "byte"
  d.vocab_size = 256  # SentencePiece vocab size (byte: fixed 256).
  d.spm_model = ""  # Given SentencePiece model file; "": train one (.bin corpora need one).
  d.seq_len = 128
  d.batch_size = 32  # Global batch (all hosts, all micro-batches of one step).
  d.num_val_works = 4  # Shakespeare: whole works held out for validation.
  d.val_fraction = 0.05  # Other text corpora: fraction of files (or tokens) held out.
  # Text corpora: skip files that are not UTF-8 (counted and named in the log and in
  # config.json's _run.data.skipped_documents) instead of refusing the corpus.
  d.skip_undecodable = False
  d.shuffle_buffer = 0  # 0: global shuffle of windows (deterministic given seed).
  d.worker_count = 0  # grain worker processes (0: in-process).
  # TEST-ONLY fault injection (train/data/poison.py): (first, count) train batches, by
  # their position in the data stream, whose targets all become the last token id. ()
  # is off; never set it in an experiment.
  d.test_poison = ()
  # corpus="mqar" (train/data/mqar.py): synthetic recall; needs seq_len + 1 >= 4 * num_kv_pairs.
  d.mqar_num_kv_pairs = 8  # Key-value bindings per sequence, each queried once.
  d.mqar_vocab = 256  # Keys from the lower half, values from the upper half.
  d.mqar_power_a = 0.01  # Query-gap power law (Zoology's default: mostly short gaps).
  # Passkey samples (train/data/passkey.py) mixed into a text corpus: this fraction of the
  # training rows is replaced by a passkey sample of seq_len + 1 tokens (0: none).
  d.passkey_fraction = 0.0
  d.passkey_needles = 1  # Needles per mixed-in sample (one is asked for).
  return d


def eval_defaults() -> ml_collections.ConfigDict:
  """config.eval: batches, context lengths, zero-shot RoPE scaling."""
  e = ml_collections.ConfigDict()
  e.batches = 8  # Batches per eval (at each context length).
  e.batch_size = 16
  e.context_lengths = (1,)  # Multiples of data.seq_len (e.g. (1, 2, 4)).
  e.at_start = False  # Also evaluate the untrained model (step 0): eval curves from step 0.
  # Zero-shot context extension: evaluate with a RoPE scaling the model was not
  # trained with ("" / 0: the model's own). Train at L, evaluate at 2L, 4L, ...
  e.rope_scaling = ""
  e.rope_scaling_factor = 0.0
  e.rope_original_max_len = 0  # With eval.rope_scaling, 0: the training length L.
  # Named evaluation corpora, "docs=prepared/docs,stdlib=src/*.txt" (prepared datasets:
  # their validation split; text files: all of it), each evaluated apart at every eval
  # as loss/<name>, bpb/<name>. A mixture's domains are always evaluated so too.
  e.corpora = ""
  # Tasks beyond the loss, at every eval: lm-evaluation-harness and retrieval tasks
  # (each field is described in train/eval/tasks.py DEFAULTS; docs/evaluation.md).
  e.update(eval_tasks.DEFAULTS)
  return e


def mesh_defaults() -> ml_collections.ConfigDict:
  """config.mesh: device mesh axis sizes (docs/scaling.md, "The mesh")."""
  m = ml_collections.ConfigDict()
  m.data = -1  # -1: all remaining devices.
  m.fsdp = 1
  # Context parallelism: the sequence split over this many devices, attention by ring
  # (docs/scaling.md, "Context parallelism"); data.seq_len must divide by 2 * context.
  m.context = 1
  m.tensor = 1
  m.expert = 1
  m.dcn_data = 1  # Multi-slice (DCN) sizes; 1 on one slice / one host.
  m.dcn_fsdp = 1
  m.dcn_context = 1
  m.dcn_tensor = 1
  m.dcn_expert = 1
  return m


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

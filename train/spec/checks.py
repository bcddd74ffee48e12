"""Every train / data / eval / mesh field checked before anything compiles (the run
spec's checks: train/spec/parse.py runs them once, on a copy with every field present).

Each error names the field, its value and what it must be, so a typo on the
command line (`--config.train.lr=-0.01`, `--config.data.seq_len=0`) fails in a
second with a sentence, not minutes later with an unrelated traceback (or, worse,
trains: a negative learning rate is gradient ascent).
"""

from __future__ import annotations

import importlib.util
import logging
import math
import numbers
import os

import jax
import ml_collections

from model import ModelConfig
from model.config import ROPE_SCALINGS
from parallel import mesh as mesh_lib
from train import spikes
from train.data import named
from train.data.corpora import eval_corpus_files
from train.optim import DECAY_SHAPES, SCHEDULES, decay_start
from train.optimizers import OPTIMIZERS
from train.spec import pipeline_checks
from train.spec.pipeline_checks import PIPELINE_SCHEDULES


class _Checker:

  def __init__(self, config: ml_collections.ConfigDict):
    self.config = config

  def value(self, field: str):
    node = self.config
    for part in field.split("."):
      node = node[part]
    return node

  def need(self, cond: bool, field: str, msg: str) -> None:
    if not cond:
      raise ValueError(f"config.{field}={self.value(field)!r}: {msg}")

  def integer(self, field: str, lo: int = 0, hi: int | None = None) -> int:
    v = self.value(field)
    ok = isinstance(v, numbers.Integral) and not isinstance(v, bool)
    self.need(ok and v >= lo and (hi is None or v <= hi), field,
              f"must be an integer >= {lo}" + (f" and <= {hi}" if hi is not None else ""))
    return int(v)

  def number(self, field: str, lo: float, hi: float = math.inf, lo_open: bool = False,
             hi_open: bool = False) -> float:
    v = self.value(field)
    ok = isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
    ok = ok and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    self.need(ok, field, f"must be a finite number in {'(' if lo_open else '['}{lo}, "
                         f"{hi}{')' if hi_open else ']'}")
    return float(v)

  def choice(self, field: str, options) -> None:
    self.need(self.value(field) in options, field, f"must be one of {tuple(options)}")


def _train(c: _Checker) -> None:
  steps = c.integer("train.steps", 1)
  c.integer("train.seed", 0, 2**32 - 1)
  c.number("train.lr", 0.0, lo_open=True)  # lr <= 0 would not train (or ascend).
  c.choice("train.schedule", SCHEDULES)
  # Longer than the run: capped (train/optim.py).
  warmup = min(c.integer("train.warmup_steps", 0), steps)
  c.number("train.decay_fraction", 0.0, 1.0)
  c.choice("train.decay_shape", DECAY_SHAPES)
  if c.value("train.schedule") == "wsd":
    c.need(decay_start(c.config.train) >= warmup, "train.decay_fraction",
           f"the cooldown would start at step {decay_start(c.config.train)}, inside the "
           f"warmup of {warmup} steps")
  for step in c.value("train.keep_steps"):  # Beyond train.steps: kept if raised later.
    c.need(isinstance(step, int) and not isinstance(step, bool) and step > 0,
           "train.keep_steps", f"each step must be a positive integer; got {step!r}")
  c.number("train.min_lr_ratio", 0.0, 1.0)
  _optimizer(c)
  c.number("train.b1", 0.0, 1.0, hi_open=True)
  c.number("train.b2", 0.0, 1.0, hi_open=True)
  c.number("train.eps", 0.0, lo_open=True)
  c.number("train.weight_decay", 0.0)
  c.number("train.grad_clip", 0.0)
  c.integer("train.grad_accum", 1)
  c.integer("train.pipeline_microbatches", 0)
  c.choice("train.pipeline_schedule", PIPELINE_SCHEDULES)
  c.integer("train.pipeline_stash", 0)
  c.integer("train.pipeline_repeats", 1)
  c.number("train.z_loss", 0.0)
  for every in ("log_every", "eval_every", "checkpoint_every", "keep_checkpoints"):
    c.integer(f"train.{every}", 1)
  c.integer("train.keep_every", 0)
  c.integer("train.local_checkpoint_every", 0)
  c.need(isinstance(c.value("train.local_checkpoint_dir"), str), "train.local_checkpoint_dir",
         "must be a path (a string; \"\": derived from the run directory)")
  c.number("train.lock_lease_s", 0.0, lo_open=True)
  for field in ("profile_steps", "profile_start"):
    c.integer(f"train.{field}", 0)
  c.choice("train.on_nonfinite", ("stop", "skip"))
  _spikes(c)
  c.need(isinstance(c.value("train.telemetry"), bool), "train.telemetry",
         "must be True or False")
  _wandb(c)


def _optimizer(c: _Checker) -> None:
  c.choice("train.optimizer", OPTIMIZERS)
  c.number("train.muon_momentum", 0.0, 1.0, hi_open=True)
  c.number("train.lion_b2", 0.0, 1.0, hi_open=True)
  if c.value("train.optimizer") == "schedule_free_adamw":
    c.need(c.value("train.schedule") == "constant", "train.schedule",
           "train.optimizer='schedule_free_adamw' replaces the decay by its averaging: use "
           "'constant' (train.warmup_steps still warms up)")


def _spikes(c: _Checker) -> None:
  threshold = c.number("train.spike_threshold", 0.0)
  c.need(threshold == 0 or threshold > 1, "train.spike_threshold",
         "must be 0 (off) or above 1 (a multiple of the running median loss)")
  c.integer("train.spike_window", 1, spikes.LOSS_HISTORY)
  c.choice("train.on_spike", spikes.POLICIES)
  poison = c.value("data.test_poison")  # A list once read back from config.json.
  ok_type = isinstance(poison, (tuple, list))
  c.need(ok_type and (len(poison) == 0 or len(poison) == 2 and all(
      isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in poison)),
         "data.test_poison", "must be () or (first batch, number of batches), test-only")


def _wandb(c: _Checker) -> None:
  """wandb is optional: asked for and missing fails now, before the run directory."""
  project = c.value("train.wandb_project")
  c.need(isinstance(project, str), "train.wandb_project",
         "must be a Weights & Biases project name, or '' (off)")
  if project:
    c.need(importlib.util.find_spec("wandb") is not None, "train.wandb_project",
           "needs the optional wandb package: pip install -e '.[wandb]' (or "
           "--config.train.wandb_project='' to log without it)")


def _data(c: _Checker) -> None:
  d = c.config.data
  c.integer("data.seq_len", 1)
  c.integer("data.batch_size", 1)
  c.integer("data.shuffle_buffer", 0)
  c.integer("data.worker_count", 0)
  c.need(isinstance(d.corpus, str) and d.corpus, "data.corpus",
         "must name a corpus: 'shakespeare', a directory or glob of .txt files, .bin "
         "token files, a prepared dataset, 'mixture' or 'mqar'")
  _mixture(c)
  if d.corpus == "mqar":
    pairs = c.integer("data.mqar_num_kv_pairs", 1)
    c.integer("data.mqar_vocab", 4)
    c.number("data.mqar_power_a", 0.0, lo_open=True)
    c.need(d.seq_len + 1 >= 4 * pairs, "data.seq_len",
           f"MQAR needs seq_len + 1 >= 4 * data.mqar_num_kv_pairs = {4 * pairs}")
    return
  _tokenizer(c)
  c.integer("data.vocab_size", 1)
  c.choice("data.token_dtype", ("uint16", "uint32"))
  c.number("data.val_fraction", 0.0, 1.0, lo_open=True, hi_open=True)
  c.choice("data.skip_undecodable", (True, False))
  if d.corpus == "shakespeare":
    c.integer("data.num_val_works", 1)


def _mixture(c: _Checker) -> None:
  """data.mixture's names and weights (absent from older runs' config.json)."""
  d = c.config.data
  datasets = named.named_paths(d.datasets, "data.datasets")
  c.choice("data.mixture_unit", ("tokens", "bytes"))
  if d.corpus == "mixture":
    named.mixture_weights(d.mixture, datasets)
  else:
    c.need(not d.mixture, "data.mixture",
           "is read only with data.corpus='mixture' (set it, or clear data.mixture)")


def _tokenizer(c: _Checker) -> None:
  """"hf:PATH" names a tokenizer.json; a missing one fails here, not after start-up."""
  kind = c.config.data.tokenizer
  hf_path = isinstance(kind, str) and kind.startswith("hf:")
  c.need(kind in ("byte", "sentencepiece", "hf") or (hf_path and len(kind) > 3),
         "data.tokenizer", "must be one of ('byte', 'sentencepiece', 'hf') or 'hf:PATH' "
         "(PATH: a Hugging Face tokenizer.json)")
  if hf_path:
    c.need(os.path.isfile(kind[3:]), "data.tokenizer", f"no such file {kind[3:]!r}")


def _eval(c: _Checker, seq_len: int) -> None:
  ev = c.config.eval
  c.choice("eval.at_start", (True, False))
  c.integer("eval.batches", 1)
  c.integer("eval.batch_size", 1)
  lengths = ev.context_lengths
  c.need(isinstance(lengths, (tuple, list)) and len(lengths) > 0 and all(
      isinstance(m, numbers.Real) and m > 0 and int(m * seq_len) >= 1 for m in lengths),
         "eval.context_lengths", "must be a non-empty tuple of positive multiples of "
         "data.seq_len, e.g. (1, 2, 4)")
  c.choice("eval.rope_scaling", ("", *ROPE_SCALINGS))
  c.number("eval.rope_scaling_factor", 0.0)
  c.integer("eval.rope_original_max_len", 0)
  for name, path in named.named_paths(ev.corpora or "", "eval.corpora").items():
    eval_corpus_files(name, path)  # Found now, not after the run directory is written.


def _mesh(c: _Checker, cfg: ModelConfig, num_devices: int) -> None:
  d, t, ev = c.config.data, c.config.train, c.config.eval
  c.need(d.batch_size % t.grad_accum == 0, "data.batch_size",
         f"must be divisible by train.grad_accum={t.grad_accum}")
  sizes = mesh_lib.mesh_shape(c.config.mesh, num_devices)
  dp = sizes["data"] * sizes["fsdp"] * sizes["expert"]
  micro = d.batch_size // t.grad_accum
  c.need(micro % dp == 0, "data.batch_size",
         f"the micro-batch {micro} (batch_size / grad_accum) must be divisible by the "
         f"data-parallel size data*fsdp*expert = {dp} (mesh {sizes}); allowed batch sizes "
         f"are multiples of {dp * t.grad_accum}")
  for axis, dims in (("tensor", ("mlp_dim", "vocab_size")),
                     ("expert", ("num_experts",) if cfg.num_experts else ())):
    for dim in dims:
      c.need(getattr(cfg, dim) % sizes[axis] == 0, f"model.{dim}",
             f"must be divisible by the mesh's {axis} size {sizes[axis]} (mesh {sizes})")
  # parallel/rules.py: "embed" (every weight's D outside the routed experts) and MLA's
  # "latent" split over fsdp x expert (fsdp alone without an expert axis).
  zero = sizes["fsdp"] * sizes["expert"]
  dims = {"d_model": cfg.d_model}
  if cfg.attention_type == "mla":  # Their resolved widths (0: full rank / 4 x head_dim).
    dims.update(q_lora_rank=cfg.mla_dims[0], kv_lora_rank=cfg.mla_dims[1])
  for dim, size in dims.items():
    c.need(size % zero == 0, f"model.{dim}",
           f"={size} must be divisible by the mesh's fsdp x expert = {zero} (mesh {sizes}): "
           "the weights outside the routed experts are split over both (parallel/rules.py)")
  c.need(ev.batch_size % dp == 0, "eval.batch_size",
         f"must be divisible by data*fsdp*expert={dp}")
  if sizes["context"] > 1:
    _context(c, cfg, sizes)
  if sizes["stage"] > 1:
    pipeline_checks.stages(c, cfg, sizes, dp)
    pipeline_checks.circular(c, cfg, sizes)
  else:
    c.need(not t.pipeline_microbatches, "train.pipeline_microbatches",
           "is read only with mesh.stage > 1 (a pipeline); leave it 0 without one")
    c.need(t.pipeline_schedule == "gpipe", "train.pipeline_schedule",
           "is read only with mesh.stage > 1 (a pipeline); leave it 'gpipe' without one")
    c.need(int(t.pipeline_repeats) == 1, "train.pipeline_repeats",
           "is read only with mesh.stage > 1 (a pipeline); leave it 1 without one")
  c.need(not t.pipeline_stash or t.pipeline_schedule == "zero_bubble", "train.pipeline_stash",
         "is read only with train.pipeline_schedule='zero_bubble'; leave it 0")


def _context(c: _Checker, cfg: ModelConfig, sizes: dict) -> None:
  """Context parallelism (mesh.context > 1): what the ring can run, refused by name."""
  d, ev, cp = c.config.data, c.config.eval, sizes["context"]
  c.need(d.seq_len % (2 * cp) == 0, "data.seq_len",
         f"must be divisible by 2 * mesh.context = {2 * cp}: ring attention cuts the "
         "sequence into two chunks per device (docs/scaling.md, \"Context parallelism\")")
  lengths = [int(m * d.seq_len) for m in ev.context_lengths]
  c.need(all(n % (2 * cp) == 0 for n in lengths), "eval.context_lengths",
         f"every evaluated length {lengths} must be divisible by 2 * mesh.context = {2 * cp}")
  c.need(cfg.attention_impl in ("auto", "ring"), "model.attention_impl",
         f"with mesh.context={cp} attention must be 'ring' (or 'auto', which picks it): "
         "the other implementations attend over the whole sequence on every device")
  c.need(not ev.tasks, "eval.tasks",
         f"task evaluation (train/eval/) is not supported with mesh.context={cp}: its rows "
         "are not cut for the ring; evaluate with --mode eval on a mesh with context=1")
  c.need(int(c.config.mesh.dcn_context or 1) == 1, "mesh.dcn_context",
         "context parallelism across slices / processes (DCN) is not supported: keep the "
         "ring within one slice or host (mesh.context) and split across them by data")


def _model_vs_data(c: _Checker, cfg: ModelConfig) -> None:
  d, ev = c.config.data, c.config.eval
  lengths = [int(m * d.seq_len) for m in ev.context_lengths]
  if cfg.pos_encoding == "learned":
    c.need(d.seq_len <= cfg.max_seq_len, "data.seq_len",
           f"exceeds model.max_seq_len={cfg.max_seq_len}, the learned position table")
    c.need(max(lengths) <= cfg.max_seq_len, "eval.context_lengths",
           f"evaluating at {max(lengths)} tokens exceeds model.max_seq_len="
           f"{cfg.max_seq_len} for learned positions")
  if d.corpus == "mqar":
    c.need(cfg.vocab_size >= d.mqar_vocab, "model.vocab_size",
           f"must be >= data.mqar_vocab={d.mqar_vocab}")
  elif d.tokenizer == "byte":
    c.need(cfg.vocab_size >= 256, "model.vocab_size", "must be >= 256 for the byte tokenizer")
  else:
    c.need(cfg.vocab_size >= d.vocab_size, "model.vocab_size",
           f"must be >= data.vocab_size={d.vocab_size} (the tokenizer's; leave "
           "model.vocab_size unset to use the tokenizer's)")


def _eval_tasks(c: _Checker, cfg: ModelConfig) -> None:
  """eval.tasks' numbers and the passkey mixture (task names: train/eval/tasks.py)."""
  d, ev = c.config.data, c.config.eval
  c.need(isinstance(ev.tasks, (str, tuple, list)), "eval.tasks",
         "must be comma-separated task names, e.g. 'passkey,hellaswag'")
  c.integer("eval.num_fewshot", -1)
  c.integer("eval.task_limit", 0)
  c.integer("eval.task_batch_size", 1)
  c.integer("eval.retrieval_samples", 1)
  c.integer("eval.retrieval_needles", 1, 16)
  c.integer("eval.retrieval_candidates", 1)
  for field in ("retrieval_lengths", "retrieval_depths"):
    v = ev[field]
    c.need(isinstance(v, (tuple, list)) and len(v) > 0 and all(
        isinstance(x, numbers.Real) and not isinstance(x, bool) for x in v),
           f"eval.{field}", "must be a non-empty tuple of numbers")
  c.need(all(0 <= x <= 1 for x in ev.retrieval_depths), "eval.retrieval_depths",
         "depths are fractions of the haystack in [0, 1]")
  c.need(all(x > 0 for x in ev.retrieval_lengths), "eval.retrieval_lengths",
         "must be positive multiples of data.seq_len")
  tasks = ev.tasks.split(",") if isinstance(ev.tasks, str) else ev.tasks
  longest = int(round(max(ev.retrieval_lengths) * d.seq_len))
  if cfg.pos_encoding == "learned" and {"passkey", "multi_needle"} & set(tasks):
    c.need(longest - 1 <= cfg.max_seq_len, "eval.retrieval_lengths",
           f"retrieval at {longest} tokens exceeds model.max_seq_len={cfg.max_seq_len}, "
           "the learned position table")
  c.number("data.passkey_fraction", 0.0, 1.0)
  c.integer("data.passkey_needles", 1, 16)


def _warn_remat_without_loop(cfg: ModelConfig) -> None:
  """Remat saves memory on XLA:CPU only inside the layer loop: unrolled (scan_unroll > 1)
  or unscanned, the recomputation is scheduled early and the activations stay alive
  (measured at config M: docs/PERFORMANCE.md, "What made it faster", first round,
  item 7). Legal, but rarely what was meant."""
  if cfg.remat != "none" and not cfg.layers_looped and jax.default_backend() == "cpu":
    logging.getLogger(__name__).warning(
        "model.remat=%r with %s: on CPU the recomputation then saves little memory; keep "
        "model.scan_layers=True and model.scan_unroll=1 for remat's saving", cfg.remat,
        "model.scan_layers=False" if not cfg.scan_layers else
        f"model.scan_unroll={cfg.scan_unroll}")


def check_sections(config: ml_collections.ConfigDict) -> None:
  """The train, data and eval sections on their own (before the model is built)."""
  c = _Checker(config)
  _train(c)
  _data(c)
  _eval(c, int(config.data.seq_len))


def check_against_model(config: ml_collections.ConfigDict, cfg: ModelConfig,
                        num_devices: int | None) -> None:
  """What depends on the model too: the mesh over `num_devices` (None: not checked, e.g.
  a compile's topology checks its own), the data's vocabulary and lengths, eval tasks."""
  c = _Checker(config)
  if num_devices is not None:
    _mesh(c, cfg, num_devices)
  _model_vs_data(c, cfg)
  _eval_tasks(c, cfg)
  _warn_remat_without_loop(cfg)

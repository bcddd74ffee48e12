"""The run directory's config.json, and config validation before anything compiles."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from typing import Any

import jax
import ml_collections

from model import ModelConfig

CONFIG_FILE = "config.json"


def _jsonable(x: Any) -> Any:
  if isinstance(x, dict):
    return {k: _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  return x


def git_commit() -> str | None:
  here = os.path.dirname(os.path.abspath(__file__))
  try:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                         text=True, timeout=5, check=False)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                           capture_output=True, text=True, timeout=5, check=False)
  except (OSError, subprocess.SubprocessError):
    return None
  if out.returncode:
    return None
  return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def write_config(workdir: str, config: ml_collections.ConfigDict) -> None:
  """config.json: the resolved config plus the code, JAX and device it ran with."""
  if jax.process_index() != 0:
    return
  os.makedirs(workdir, exist_ok=True)
  record = _jsonable(config.to_dict())
  record["_run"] = {
      "git_commit": git_commit(), "jax_version": jax.__version__,
      "device_kind": jax.devices()[0].device_kind, "device_count": jax.device_count(),
      "process_count": jax.process_count(),
  }
  tmp = os.path.join(workdir, CONFIG_FILE + ".tmp")
  with open(tmp, "w") as f:
    json.dump(record, f, indent=2, sort_keys=True)
  os.replace(tmp, os.path.join(workdir, CONFIG_FILE))


def read_config(workdir: str) -> ml_collections.ConfigDict:
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} not found: {workdir!r} is not a blockwork run directory")
  with open(path) as f:
    record = json.load(f)
  record.pop("_run", None)
  return ml_collections.ConfigDict(record)


def model_config(config: ml_collections.ConfigDict) -> ModelConfig:
  return ModelConfig.from_dict(config.model.to_dict())


def check_compatible(saved: ml_collections.ConfigDict, current: ModelConfig) -> None:
  """Refuses to resume when the model's parameter shapes would differ."""
  from model.transformer import Transformer  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  old = model_config(saved)
  shapes = lambda cfg: jax.tree.map(lambda x: x.shape, jax.eval_shape(
      lambda: Transformer(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))))
  if shapes(old) != shapes(current):
    diff = [f"{f.name}: checkpoint {getattr(old, f.name)!r} vs config {getattr(current, f.name)!r}"
            for f in dataclasses.fields(ModelConfig)
            if getattr(old, f.name) != getattr(current, f.name)]
    raise ValueError("the config's model shape differs from the checkpoint's; refusing to "
                     "resume. Differing fields: " + "; ".join(diff))


def validate(config: ml_collections.ConfigDict, num_devices: int) -> ModelConfig:
  """All config errors, before anything compiles; returns the ModelConfig."""
  cfg = model_config(config)  # ModelConfig validates its own fields.
  d, t, ev = config.data, config.train, config.eval

  def need(cond, field, msg):
    if not cond:
      raise ValueError(f"config.{field}={_get(config, field)!r}: {msg}")

  need(t.steps > 0, "train.steps", "must be a positive integer")
  need(t.grad_accum >= 1, "train.grad_accum", "must be >= 1")
  need(d.batch_size % t.grad_accum == 0, "data.batch_size",
       f"must be divisible by train.grad_accum={t.grad_accum}")
  from parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  sizes = mesh_lib.mesh_shape(config.mesh, num_devices)
  dp = sizes["data"] * sizes["fsdp"] * sizes["expert"]
  micro = d.batch_size // t.grad_accum
  need(micro % dp == 0, "data.batch_size",
       f"the micro-batch {micro} (batch_size / grad_accum) must be divisible by the "
       f"data-parallel size data*fsdp*expert = {dp} (mesh {sizes}); allowed batch sizes "
       f"are multiples of {dp * t.grad_accum}")
  for axis, dims in (("fsdp", ("d_model",)), ("tensor", ("mlp_dim", "vocab_size")),
                     ("expert", ("num_experts",) if cfg.num_experts else ())):
    for dim in dims:
      need(getattr(cfg, dim) % sizes[axis] == 0, f"model.{dim}",
           f"must be divisible by the mesh's {axis} size {sizes[axis]} (mesh {sizes})")
  need(ev.batch_size % dp == 0, "eval.batch_size", f"must be divisible by data*fsdp*expert={dp}")
  need(t.on_nonfinite in ("stop", "skip"), "train.on_nonfinite", "must be 'stop' or 'skip'")
  need(t.schedule in ("cosine", "linear", "constant"), "train.schedule",
       "must be one of ('cosine', 'linear', 'constant')")
  need(0 <= t.warmup_steps <= t.steps, "train.warmup_steps", f"must be in [0, {t.steps}]")
  need(t.log_every > 0 and t.eval_every > 0 and t.checkpoint_every > 0, "train.log_every",
       "log_every, eval_every and checkpoint_every must be positive")
  lengths = [int(m * d.seq_len) for m in ev.context_lengths]
  if cfg.pos_encoding == "learned":
    need(d.seq_len <= cfg.max_seq_len, "data.seq_len",
         f"exceeds model.max_seq_len={cfg.max_seq_len}, the learned position table")
    need(max(lengths) <= cfg.max_seq_len, "eval.context_lengths",
         f"evaluating at {max(lengths)} tokens exceeds model.max_seq_len={cfg.max_seq_len} "
         "for learned positions")
  if d.corpus == "mqar":
    need(cfg.vocab_size >= d.mqar_vocab, "model.vocab_size",
         f"must be >= data.mqar_vocab={d.mqar_vocab}")
  elif d.tokenizer == "byte":
    need(cfg.vocab_size >= 256, "model.vocab_size", "must be >= 256 for the byte tokenizer")
  else:
    need(cfg.vocab_size >= d.vocab_size, "model.vocab_size",
         f"must be >= data.vocab_size={d.vocab_size} (the tokenizer's)")
  return cfg


def _get(config, dotted: str):
  node = config
  for part in dotted.split("."):
    node = node[part]
  return node

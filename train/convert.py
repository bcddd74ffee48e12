"""`launch.py --mode convert`: MHA -> GQA / MQA conversion of a trained run
(Ainslie et al. 2023, "GQA", section 2.1), the first half of uptraining.

    python launch.py --mode convert --from_run runs/mha --workdir runs/gqa2 \
        --config.model.num_kv_heads=2 [--convert_method=mean|first|random]
    python launch.py --config experiments/configs/from_run.py:runs/gqa2 \
        --workdir runs/gqa2 --config.train.steps=60        # uptrain: continue DST

The destination is a step-0 run: the source's config with the overrides, every
parameter copied except those with a `kv_heads` axis (K and V projections, their
biases), which are pooled over each group of source heads that one new KV head
serves (query head n uses KV head n // G, so groups are contiguous):
  mean    the group's mean (the paper's method, its best)
  first   the group's first head
  random  freshly initialised (the paper's baseline)
K equal to the source's is the identity. config.json's `_run` records the source
run, its step and the method.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from model import Transformer
from model.transformer import abstract_variables

from train import checkpoint as ckpt
from train.io import storage
from train.lifecycle import config_record, session
from train.lifecycle.load import load_run
from train.spec import RunSpec

METHODS = ("mean", "first", "random")


def _pool(x: np.ndarray, axis: int, num_kv_heads: int, method: str) -> np.ndarray:
  """[..., K_old, ...] -> [..., K, ...] over contiguous groups of K_old / K heads."""
  k_old = x.shape[axis]
  grouped = x.reshape(x.shape[:axis] + (num_kv_heads, k_old // num_kv_heads) +
                      x.shape[axis + 1:])
  return grouped.mean(axis + 1) if method == "mean" else np.take(grouped, 0, axis=axis + 1)


def convert_params(params: Any, old_cfg, new_cfg, method: str, seed: int) -> Any:
  """The source's parameters with every `kv_heads` axis pooled to new_cfg.num_kv_heads."""
  tokens_BL = jnp.zeros((1, 8), jnp.int32)
  boxed = abstract_variables(old_cfg, unbox=False)
  names = jax.tree.map(lambda b: b.names, boxed["params"],
                       is_leaf=lambda b: isinstance(b, nn.LogicallyPartitioned))
  fresh = None
  if method == "random":
    fresh = nn.unbox(jax.jit(lambda: Transformer(new_cfg).init(
        jax.random.key(seed), tokens_BL))())["params"]

  def convert(path, x, axes):
    if "kv_heads" not in axes:
      return np.asarray(x)
    if method == "random":
      return np.asarray(_lookup(fresh, path))
    return _pool(np.asarray(x, np.float32), axes.index("kv_heads"), new_cfg.num_kv_heads,
                 method).astype(np.asarray(x).dtype)

  return jax.tree_util.tree_map_with_path(
      convert, params, names, is_leaf=lambda a: isinstance(a, tuple))


def _lookup(tree, path):
  for key in path:
    tree = tree[key.key]
  return tree


def convert_run(src: str, dst: str, overrides: dict[str, Any] | None = None,
                method: str = "mean") -> dict:
  """Writes the step-0 run `dst` converted from `src`'s latest checkpoint; returns its
  `_run` record. Only `model.num_kv_heads` may change in the model section."""
  if method not in METHODS:
    raise ValueError(f"--convert_method={method!r}: must be one of {METHODS}")
  if found := config_record.contents(dst):
    raise FileExistsError(f"{dst} already holds a run ({'; '.join(found)}); convert into a "
                          "new --workdir")
  overrides = dict(overrides or {})
  model_changes = sorted(k for k in overrides if k.startswith("model.")
                         and k != "model.num_kv_heads")
  if model_changes:
    raise ValueError(f"--mode convert changes only model.num_kv_heads; got {model_changes} "
                     "(the other weights are copied and must keep their shapes)")
  run = load_run(src)
  config = run.config
  for path, value in overrides.items():
    section, leaf = path.split(".", 1)
    config[section][leaf] = tuple(value) if isinstance(value, list) else value
  old_cfg = run.model_config
  k_new = int(config.model.num_kv_heads)
  if k_new < 1 or old_cfg.num_kv_heads % k_new:
    raise ValueError(f"config.model.num_kv_heads={k_new}: must divide the source's "
                     f"num_kv_heads={old_cfg.num_kv_heads} (and so num_heads="
                     f"{old_cfg.num_heads}): each new KV head pools a whole group")
  with session.open_run(config, dst, "convert") as s:  # dst's LOCK: one writer.
    return _write(src, dst, s.spec, run, method)


def _write(src: str, dst: str, spec: RunSpec, run, method: str) -> dict:
  """The converted weights and records of `dst` (its LOCK held)."""
  old_cfg = run.model_config
  params = convert_params(run.variables["params"], old_cfg, spec.model, method,
                          int(spec.train.seed))
  model_state = {k: v for k, v in run.variables.items() if k != "params"}
  source = {"converted_from": storage.absolute(src), "source_step": run.step,
            "convert_method": method, "source_num_kv_heads": old_cfg.num_kv_heads}
  as_jax = lambda t: jax.tree.map(jnp.asarray, t)
  # The source's tokenizer and data record: training on continues with that tokenizer.
  if jax.process_index() == 0:  # One writer of a run's records; either may be a bucket.
    storage.copy_tree(storage.join(src, "tokenizer"), storage.join(dst, "tokenizer"))
  data = session.recorded_data(src)
  environment = {**config_record.environment(), **source, **({"data": data} if data else {})}
  ckpt.save_imported(dst, spec, as_jax(params), as_jax(model_state), environment)
  return source

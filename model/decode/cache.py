"""The KV cache decoding carries: the config decoding runs with, the variables it
takes, the cache's shapes and size; the check that it fits in
memory is host code (train/decode_memory.py).

A global layer's cache holds every slot of the generation ([B, S, K, H] keys and
values, [B, S] segment ids and positions, a write index); a local layer's
(ModelConfig.layer_kind(i).window > 0) is a ring buffer of min(window, S) slots
(written by model/attention/kv_cache.py), so its size stops growing at the window.
An MLA layer (attention_type="mla", model/attention/mla.py) caches one [B, S, kv_lora_rank +
qk_rope_head_dim] row array (the normalised latent beside the shared rope key)
instead of keys and values.

`kv_bytes_per_token` is THE KV-bytes-per-token figure (the GQA ablation report's
axis): read off the same cache shapes, so MHA, GQA, MQA and MLA are counted alike.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.config import ModelConfig
from model.transformer import Transformer
from model.transformer import unstack_layers as unstack_collection


def decode_config(cfg: ModelConfig) -> ModelConfig:
  """The config decoding runs with: unrolled layers, MoE without capacity drops.

  A routing group is one sequence, so a 1-token decode step never drops, but
  prefill routes the padded prompt (pads included) as one group: with a
  capacity limit, pad slots would compete for expert slots and a prompt's
  continuation would depend on its padding. Factor 0 (C = L) drops nothing
  and otherwise computes what capacity routing computes.
  """
  changes: dict[str, Any] = dict(scan_layers=False, remat="none")
  if cfg.num_experts and (cfg.capacity_factor > 0 or cfg.eval_capacity_factor):
    changes.update(capacity_factor=0.0, eval_capacity_factor=None)
  return cfg.replace(**changes)


def unstack_layers(cfg: ModelConfig, variables: Any) -> dict[str, Any]:
  """Variables of Transformer(cfg) -> those of Transformer(decode_config(cfg)).

  Unrolled, layer i is `layer_{i}` (model/transformer.py's unstack_layers, per
  collection). Unboxes logical-axis metadata; drops any cache.
  """
  variables = {k: v for k, v in nn.unbox(variables).items() if k != "cache"}
  if not cfg.scan_layers:
    return variables
  return {c: unstack_collection(cfg, tree) for c, tree in variables.items()}


@functools.lru_cache(maxsize=64)
def cache_shapes(cfg: ModelConfig, batch: int, length: int) -> Any:
  """ShapeDtypeStructs of the cache decoding uses (eval_shape of its init; memoised).

  One {"attn": {"cached_key", "cached_value": [B, S, K, H], "segment_ids",
  "positions": [B, S], "index": []}} per layer, under "layer_{i}"; S = length, or
  min(window, length) for a local layer. MLA layers hold "cached_latent" [B, S, A + P]
  instead of the keys and values.
  """
  # The init input is [batch, length]; a learned table must not reject that
  # length (decode positions, not slots, index the table; see check_length).
  cfg = decode_config(cfg).replace(max_seq_len=max(cfg.max_seq_len, length))

  def init():
    tokens_BS = jnp.zeros((batch, length), jnp.int32)
    return Transformer(cfg).init(jax.random.key(0), tokens_BS, decode=True)["cache"]
  return jax.eval_shape(init)


def cache_bytes(cfg: ModelConfig, batch: int, length: int) -> int:
  """Bytes of the KV cache (keys, values, segment ids, positions, index)."""
  leaves = jax.tree.leaves(cache_shapes(cfg, batch, length))
  return int(sum(x.size * jnp.dtype(x.dtype).itemsize for x in leaves))


def kv_bytes_per_token(cfg: ModelConfig) -> int:
  """Bytes of cached keys and values (MLA: latent rows) per token, summed over layers,
  in the compute dtype; segment ids and positions are bookkeeping, not counted. A
  local layer counts while the cache is shorter than its window (the ring's growth)."""
  def kv_bytes(length: int) -> int:
    flat = jax.tree_util.tree_flatten_with_path(cache_shapes(cfg, 1, length))[0]
    return int(sum(x.size * jnp.dtype(x.dtype).itemsize for path, x in flat
                   if str(getattr(path[-1], "key", "")).startswith("cached_")))
  return kv_bytes(2) - kv_bytes(1)


def init_cache(cfg: ModelConfig, batch: int, length: int) -> Any:
  """An empty cache: all zeros (segment 0 = empty slot, write index 0)."""
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cache_shapes(cfg, batch, length))

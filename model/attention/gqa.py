"""Grouped-query attention (MHA / GQA / MQA), masks and the KV cache.

Query heads are grouped by the KV head they share: `q_BLKGH` against
`k_BSKH`, so K/V are never repeated to N heads in memory. MHA is G = 1,
MQA is K = 1.

Masks follow slot indices (the order of tokens in the sequence or in the
cache), not positions: causal is `kv_slot <= q_slot`, the sliding window is
`q_slot - kv_slot < window`, and segment ids keep packed documents (and
padding, segment 0) apart. Positions only feed the positional encodings, so
shifting every position by a constant never changes the mask.

Each layer has its own kind (ModelConfig.layer_kind: its window and whether it
rotates), static for that layer. A local layer (window > 0) decodes from a ring
buffer of min(window, S_max) slots instead of a full-length cache.

The score computation is chosen once from `cfg.attention_impl` through IMPLS:
"xla" (the reference, model/attention/reference.py), "blockwise" (flash attention in
pure JAX, model/attention/blockwise.py), "cudnn" and "splash" (model/attention/kernels.py);
"auto" is settled by `resolve_attention_impl`.
"""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from model import backend as target, positional
from model.attention import kernels as attention_kernels, scores
from model.attention.reference import AttendFn, AttnData, spec_from_config, xla_attention
from model.attention.reference import attend, make_mask  # noqa: F401  (the reference, re-exported)
from model.attention.blockwise import blockwise_attention
from model.config import LayerKind, ModelConfig
from model.layers import Bias, Einsum, make_norm

IMPLS: dict[str, AttendFn] = {
    "xla": xla_attention,
    "blockwise": blockwise_attention,
    "cudnn": attention_kernels.cudnn_attention,
    "splash": attention_kernels.splash_attention,
}
VENDOR_KERNELS = ("cudnn", "splash")  # Each runs on one backend only.
# Queries from which "auto" runs blockwise rather than the reference. CPU is measured
# (docs/PERFORMANCE.md, "Attention implementations": blockwise is no slower from one
# 256-block up and far faster from two); GPU / TPU fall back to it only where their
# kernel cannot serve the config, and keep the reference up to where its [L, S]
# scores start to cost memory, unmeasured.
BLOCKWISE_MIN_LEN = {"cpu": 512, "gpu": 2048, "tpu": 2048}


def resolve_attention_impl(cfg: ModelConfig, backend: str, seq_len: int) -> str:
  """The implementation `cfg.attention_impl` runs for `seq_len` queries on `backend`.

  Explicit choices are returned as they are; "auto" picks the fastest that serves
  the config: TPU -> Splash (under a mesh, shard_mapped over the batch and KV-head
  axes), GPU (bfloat16, no soft-cap, no ALiBi) -> cuDNN, else blockwise from
  BLOCKWISE_MIN_LEN[backend] queries and the reference below. Decoding always runs "xla".
  """
  if cfg.attention_impl != "auto":
    return cfg.attention_impl
  if backend == "tpu" and not attention_kernels.unsupported("splash", cfg):
    return "splash"
  # cuDNN would take a score bias (ALiBi) as a dense [B, N, L, S] array: blockwise computes
  # it per block.
  if (backend == "gpu" and not scores.active_biases(spec_from_config(cfg)) and
      not attention_kernels.unsupported("cudnn", cfg)):
    return "cudnn"
  return "blockwise" if seq_len >= BLOCKWISE_MIN_LEN.get(backend, 2048) else "xla"


class Attention(nn.Module):
  """Self-attention with projections, QK-norm, positional encodings and a KV cache."""

  cfg: ModelConfig
  kind: LayerKind | None = None  # None: layer 0's (the whole stack's, without patterns).

  @nn.compact
  def __call__(self, x_BLD: jax.Array, positions_BL: jax.Array, segment_ids_BL: jax.Array,
               decode: bool = False) -> jax.Array:
    cfg = self.cfg
    kind = self.kind or cfg.layer_kind(0)
    B, L, D = x_BLD.shape
    N, K, G, H = cfg.num_heads, cfg.num_kv_heads, cfg.num_groups, cfg.resolved_head_dim
    kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, init_std=cfg.init_std)
    q_BLNH = Einsum((D, N, H), ("embed", "heads", "head_dim"), name="q", **kw)(
        "BLD,DNH->BLNH", x_BLD)
    k_BLKH = Einsum((D, K, H), ("embed", "kv_heads", "head_dim"), name="k", **kw)(
        "BLD,DKH->BLKH", x_BLD)
    v_BLKH = Einsum((D, K, H), ("embed", "kv_heads", "head_dim"), name="v", **kw)(
        "BLD,DKH->BLKH", x_BLD)
    if cfg.attn_bias:
      q_BLNH = Bias((N, H), ("heads", "head_dim"), cfg.param_dtype, name="q_bias")(q_BLNH)
      k_BLKH = Bias((K, H), ("kv_heads", "head_dim"), cfg.param_dtype, name="k_bias")(k_BLKH)
      v_BLKH = Bias((K, H), ("kv_heads", "head_dim"), cfg.param_dtype, name="v_bias")(v_BLKH)
    if cfg.qk_norm:
      q_BLNH = make_norm(cfg, "q_norm", axis_name="head_dim")(q_BLNH)
      k_BLKH = make_norm(cfg, "k_norm", axis_name="head_dim")(k_BLKH)
    if kind.rope:
      seq_len = jnp.max(positions_BL) + 1
      q_BLNH = positional.apply_rope(q_BLNH, positions_BL, cfg, seq_len)
      k_BLKH = positional.apply_rope(k_BLKH, positions_BL, cfg, seq_len)
    q_BLNH = nn.with_logical_constraint(q_BLNH, ("batch", "length", "heads", "head_dim"))
    k_BLKH = nn.with_logical_constraint(k_BLKH, ("batch", "length", "kv_heads", "head_dim"))
    q_BLKGH = q_BLNH.reshape(B, L, K, G, H)

    kv_slots_S = None
    if decode and kind.window:
      k_BSKH, v_BSKH, kv_segment_ids_BS, kv_positions_BS, kv_slots_S, start = (
          self._ring_cache(k_BLKH, v_BLKH, segment_ids_BL, positions_BL, kind.window))
    elif decode:
      k_BSKH, v_BSKH, kv_segment_ids_BS, kv_positions_BS, start = self._update_cache(
          k_BLKH, v_BLKH, segment_ids_BL, positions_BL)
    else:
      k_BSKH, v_BSKH, kv_segment_ids_BS, kv_positions_BS, start = (
          k_BLKH, v_BLKH, segment_ids_BL, positions_BL, None)
    data = AttnData(segment_ids_BL, kv_segment_ids_BS, positions_BL, kv_positions_BS, start,
                    kv_slots_S)
    # Decoding attends from a cache offset, which only the reference serves.
    impl = "xla" if decode else resolve_attention_impl(cfg, target.backend(), L)
    if self.is_initializing() and impl in VENDOR_KERNELS:
      # Init needs only shapes, and blockwise runs anywhere in linear memory: a GPU / TPU
      # config initialises (and restores, through eval_shape of init) on any host.
      impl = "blockwise"
    out_BLKGH = IMPLS[impl](q_BLKGH, k_BSKH, v_BSKH, data,
                            spec_from_config(cfg, kind.window))
    out_BLNH = out_BLKGH.reshape(B, L, N, H)
    out_BLD = Einsum((N, H, D), ("heads", "head_dim", "embed"), name="o", **kw)(
        "BLNH,NHD->BLD", out_BLNH)
    chex.assert_equal_shape([x_BLD, out_BLD])
    return out_BLD

  def _cache_vars(self, B: int, S: int, K: int, H: int):
    dtype = jnp.dtype(self.cfg.dtype)
    return (self.variable("cache", "cached_key", jnp.zeros, (B, S, K, H), dtype),
            self.variable("cache", "cached_value", jnp.zeros, (B, S, K, H), dtype),
            self.variable("cache", "segment_ids", jnp.zeros, (B, S), jnp.int32),
            self.variable("cache", "positions", jnp.zeros, (B, S), jnp.int32),
            self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32)))

  def _update_cache(self, k_BLKH, v_BLKH, segment_ids_BL, positions_BL):
    """Writes L new entries at the cache index; returns the whole cache.

    The cache is sized by the first call (the `init` of decoding, with a
    [B, S_max] dummy input): [B, S_max, K, H] for K and V, by KV heads.
    """
    B, L, K, H = k_BLKH.shape
    is_init = not self.has_variable("cache", "cached_key")
    k_var, v_var, seg_var, pos_var, idx_var = self._cache_vars(B, L, K, H)
    if is_init:
      return k_BLKH, v_BLKH, segment_ids_BL, positions_BL, jnp.zeros((), jnp.int32)
    start = idx_var.value
    upd = lambda buf, new: jax.lax.dynamic_update_slice_in_dim(buf, new.astype(buf.dtype),
                                                               start, axis=1)
    k_var.value = upd(k_var.value, k_BLKH)
    v_var.value = upd(v_var.value, v_BLKH)
    seg_var.value = upd(seg_var.value, segment_ids_BL)
    pos_var.value = upd(pos_var.value, positions_BL)
    idx_var.value = start + L
    return k_var.value, v_var.value, seg_var.value, pos_var.value, start

  def _ring_cache(self, k_BLKH, v_BLKH, segment_ids_BL, positions_BL, window: int):
    """A local layer's cache: a ring of R = min(window, S_max) slots; slot s is entry s % R.

    The call's queries attend over the ring's entries and the call's own keys, concatenated
    (writing first would let a prompt longer than R overwrite keys its first queries
    need); then the newest min(L, R) keys are written. Returns what `_update_cache`
    does, plus kv_slots_S: the slot of each returned key (the mask follows slots).
    """
    B, L, K, H = k_BLKH.shape
    is_init = not self.has_variable("cache", "cached_key")
    k_var, v_var, seg_var, pos_var, idx_var = self._cache_vars(B, min(window, L), K, H)
    if is_init:
      return k_BLKH, v_BLKH, segment_ids_BL, positions_BL, None, jnp.zeros((), jnp.int32)
    R = k_var.value.shape[1]
    start = idx_var.value
    # Entry r holds the newest slot s < start with s % R == r; a negative s was never
    # written (segment 0: no real query attends to it).
    ring_slots_R = start - 1 - jnp.mod(start - 1 - jnp.arange(R), R)
    kv_slots_S = jnp.concatenate([ring_slots_R, start + jnp.arange(L)])
    news = (k_BLKH, v_BLKH, segment_ids_BL, positions_BL)
    out = []
    m = min(L, R)  # Distinct entries: only the last R of a longer chunk are kept.
    entries_M = jnp.mod(start + L - m + jnp.arange(m), R)
    for var, new in zip((k_var, v_var, seg_var, pos_var), news):
      new = new.astype(var.value.dtype)
      out.append(jnp.concatenate([var.value, new], axis=1))
      var.value = var.value.at[:, entries_M].set(new[:, L - m:])
    idx_var.value = start + L
    chex.assert_shape(out[0], (B, R + L, K, H))
    return (*out, kv_slots_S, start)

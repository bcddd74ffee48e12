"""Grouped-query attention (MHA / GQA / MQA), masks and the KV cache.

Query heads are grouped by the KV head they share: `q_BLKGH` against
`k_BSKH`, so K/V are never repeated to N heads in memory. MHA is G = 1,
MQA is K = 1.

Masks follow slot indices (the order of tokens in the sequence or in the
cache), not positions: causal is `kv_slot <= q_slot`, the sliding window is
`q_slot - kv_slot < window`, and segment ids keep packed documents (and
padding, segment 0) apart. Positions only feed the positional encodings, so
shifting every position by a constant never changes the mask.

The score computation is chosen once from `cfg.attention_impl` through IMPLS:
"xla" (the reference, model/attention_impl.py), "blockwise" (flash attention in
pure JAX, model/blockwise.py), "cudnn" and "splash" (model/attention_kernels.py);
"auto" is settled by `resolve_attention_impl`.
"""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from model import attention_kernels, positional
from model.attention_impl import AttendFn, AttnData, spec_from_config, xla_attention
from model.attention_impl import attend, make_mask  # noqa: F401  (the reference, re-exported)
from model.blockwise import blockwise_attention
from model.config import ModelConfig
from model.layers import Bias, Einsum, dtype_of, make_norm

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


def resolve_attention_impl(cfg: ModelConfig, backend: str, seq_len: int,
                           num_devices: int | None = None) -> str:
  """The implementation `cfg.attention_impl` runs for `seq_len` queries on `backend`.

  Explicit choices are returned as they are; "auto" picks the fastest that serves
  the config: TPU -> Splash, GPU (bfloat16, no soft-cap, no ALiBi) -> cuDNN, else
  blockwise from BLOCKWISE_MIN_LEN[backend] queries and the reference below. Splash is
  called on whole arrays (no shard_map), so "auto" uses it on one device only
  (`num_devices`, default jax.device_count()). Decoding always runs "xla".
  """
  if cfg.attention_impl != "auto":
    return cfg.attention_impl
  if num_devices is None:
    num_devices = jax.device_count()
  if backend == "tpu" and num_devices == 1 and not attention_kernels.unsupported("splash", cfg):
    return "splash"
  # cuDNN would take ALiBi as a dense [B, N, L, S] bias: blockwise computes it per block.
  if (backend == "gpu" and cfg.pos_encoding != "alibi" and
      not attention_kernels.unsupported("cudnn", cfg)):
    return "cudnn"
  return "blockwise" if seq_len >= BLOCKWISE_MIN_LEN.get(backend, 2048) else "xla"


class Attention(nn.Module):
  """Self-attention with projections, QK-norm, positional encodings and a KV cache."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BLD: jax.Array, positions_BL: jax.Array, segment_ids_BL: jax.Array,
               decode: bool = False) -> jax.Array:
    cfg = self.cfg
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
    if cfg.pos_encoding == "rope":
      seq_len = jnp.max(positions_BL) + 1
      q_BLNH = positional.apply_rope(q_BLNH, positions_BL, cfg, seq_len)
      k_BLKH = positional.apply_rope(k_BLKH, positions_BL, cfg, seq_len)
    q_BLNH = nn.with_logical_constraint(q_BLNH, ("batch", "length", "heads", "head_dim"))
    k_BLKH = nn.with_logical_constraint(k_BLKH, ("batch", "length", "kv_heads", "head_dim"))
    q_BLKGH = q_BLNH.reshape(B, L, K, G, H)

    if decode:
      k_BSKH, v_BSKH, kv_segment_ids_BS, kv_positions_BS, start = self._update_cache(
          k_BLKH, v_BLKH, segment_ids_BL, positions_BL)
    else:
      k_BSKH, v_BSKH, kv_segment_ids_BS, kv_positions_BS, start = (
          k_BLKH, v_BLKH, segment_ids_BL, positions_BL, None)
    data = AttnData(segment_ids_BL, kv_segment_ids_BS, positions_BL, kv_positions_BS, start)
    # Decoding attends from a cache offset, which only the reference serves.
    impl = "xla" if decode else resolve_attention_impl(cfg, jax.default_backend(), L)
    if self.is_initializing() and impl in VENDOR_KERNELS:
      # Init needs only shapes, and blockwise runs anywhere in linear memory: a GPU / TPU
      # config initialises (and restores, through eval_shape of init) on any host.
      impl = "blockwise"
    out_BLKGH = IMPLS[impl](q_BLKGH, k_BSKH, v_BSKH, data, spec_from_config(cfg))
    out_BLNH = out_BLKGH.reshape(B, L, N, H)
    out_BLD = Einsum((N, H, D), ("heads", "head_dim", "embed"), name="o", **kw)(
        "BLNH,NHD->BLD", out_BLNH)
    chex.assert_equal_shape([x_BLD, out_BLD])
    return out_BLD

  def _update_cache(self, k_BLKH, v_BLKH, segment_ids_BL, positions_BL):
    """Writes L new entries at the cache index; returns the whole cache.

    The cache is sized by the first call (the `init` of decoding, with a
    [B, S_max] dummy input): [B, S_max, K, H] for K and V, by KV heads.
    """
    B, L, K, H = k_BLKH.shape
    is_init = not self.has_variable("cache", "cached_key")
    dtype = dtype_of(self.cfg.dtype)
    k_var = self.variable("cache", "cached_key", jnp.zeros, (B, L, K, H), dtype)
    v_var = self.variable("cache", "cached_value", jnp.zeros, (B, L, K, H), dtype)
    seg_var = self.variable("cache", "segment_ids", jnp.zeros, (B, L), jnp.int32)
    pos_var = self.variable("cache", "positions", jnp.zeros, (B, L), jnp.int32)
    idx_var = self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
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

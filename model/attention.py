"""Grouped-query attention (MHA / GQA / MQA), masks and the KV cache.

Query heads are grouped by the KV head they share: `q_BLKGH` against
`k_BSKH`, so K/V are never repeated to N heads in memory. MHA is G = 1,
MQA is K = 1.

Masks follow slot indices (the order of tokens in the sequence or in the
cache), not positions: causal is `kv_slot <= q_slot`, the sliding window is
`q_slot - kv_slot < window`, and segment ids keep packed documents (and
padding, segment 0) apart. Positions only feed the positional encodings, so
shifting every position by a constant never changes the mask.
"""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from model import positional
from model.config import ModelConfig
from model.layers import Bias, Einsum, dtype_of, make_norm

NEG_INF = -1e30  # Finite: a fully masked row gives a uniform softmax, not NaN.


def make_mask(q_slots_L: jax.Array, kv_slots_S: jax.Array, q_segment_ids_BL: jax.Array,
              kv_segment_ids_BS: jax.Array, sliding_window: int = 0) -> jax.Array:
  """Boolean mask_BLS: True where query l may attend to key s."""
  causal_LS = kv_slots_S[None, :] <= q_slots_L[:, None]
  if sliding_window:
    causal_LS &= q_slots_L[:, None] - kv_slots_S[None, :] < sliding_window
  same_doc_BLS = q_segment_ids_BL[:, :, None] == kv_segment_ids_BS[:, None, :]
  return causal_LS[None] & same_doc_BLS


def attend(q_BLKGH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, mask_BLS: jax.Array,
           *, scale: float, softcap: float = 0.0, bias_BKGLS: jax.Array | None = None
           ) -> jax.Array:
  """Scaled dot-product attention over grouped heads; softmax in float32."""
  B, L, K, G, H = q_BLKGH.shape
  S = k_BSKH.shape[1]
  chex.assert_shape([k_BSKH, v_BSKH], (B, S, K, H))
  chex.assert_shape(mask_BLS, (B, L, S))
  scores_BKGLS = jnp.einsum("BLKGH,BSKH->BKGLS", q_BLKGH, k_BSKH,
                            preferred_element_type=jnp.float32) * scale
  if softcap:
    scores_BKGLS = softcap * jnp.tanh(scores_BKGLS / softcap)
  if bias_BKGLS is not None:
    scores_BKGLS = scores_BKGLS + bias_BKGLS
  scores_BKGLS = jnp.where(mask_BLS[:, None, None], scores_BKGLS, NEG_INF)
  probs_BKGLS = jax.nn.softmax(scores_BKGLS, axis=-1).astype(v_BSKH.dtype)
  return jnp.einsum("BKGLS,BSKH->BLKGH", probs_BKGLS, v_BSKH,
                    preferred_element_type=jnp.float32).astype(v_BSKH.dtype)


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

    q_slots_L = jnp.arange(L)
    if decode:
      k_BSKH, v_BSKH, kv_segment_ids_BS, kv_positions_BS, start = self._update_cache(
          k_BLKH, v_BLKH, segment_ids_BL, positions_BL)
      q_slots_L = q_slots_L + start
    else:
      k_BSKH, v_BSKH, kv_segment_ids_BS, kv_positions_BS = (
          k_BLKH, v_BLKH, segment_ids_BL, positions_BL)
    S = k_BSKH.shape[1]
    mask_BLS = make_mask(q_slots_L, jnp.arange(S), segment_ids_BL, kv_segment_ids_BS,
                         cfg.sliding_window)
    bias_BKGLS = None
    if cfg.pos_encoding == "alibi":
      bias_BNLS = positional.alibi_bias(positions_BL, kv_positions_BS, N)
      bias_BKGLS = bias_BNLS.reshape(B, K, G, L, S)
    scale = cfg.attn_scale if cfg.attn_scale is not None else H ** -0.5
    out_BLKGH = attend(q_BLKGH, k_BSKH, v_BSKH, mask_BLS, scale=scale,
                       softcap=cfg.attn_logit_softcap, bias_BKGLS=bias_BKGLS)
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

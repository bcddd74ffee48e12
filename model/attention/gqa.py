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
buffer of min(window, S_max) slots instead of a full-length cache; both caches are
written by model/attention/kv_cache.py, MLA's too.

The score computation is the entry of model/attention/impls.py's table that
`layer_impl` picks (the same for MLA); IMPLS and `resolve_attention_impl` are
re-exported here.
"""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from model import mup, positional, telemetry
from model.attention import kv_cache
from model.attention.impls import IMPLS, layer_impl, resolve_attention_impl  # noqa: F401
from model.attention.reference import AttnData, spec_from_config
from model.attention.reference import attend, make_mask  # noqa: F401  (the reference, re-exported)
from model.config import LayerKind, ModelConfig
from model.layers import Bias, Einsum, make_norm

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
    kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, init_std=mup.hidden_init_std(cfg))
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

    if decode:
      (k_BSKH, v_BSKH), data = kv_cache.write(
          self, ("cached_key", "cached_value"), (k_BLKH, v_BLKH), segment_ids_BL, positions_BL,
          dtype=cfg.dtype, window=kind.window)
    else:
      k_BSKH, v_BSKH = k_BLKH, v_BLKH
      data = AttnData(segment_ids_BL, segment_ids_BL, positions_BL, positions_BL)
    report = telemetry.enabled(self) and not decode
    attend_fn = layer_impl(cfg, L, decode=decode, initializing=self.is_initializing(),
                           with_max=report)
    out_BLKGH = attend_fn(q_BLKGH, k_BSKH, v_BSKH, data, spec_from_config(cfg, kind.window))
    if report:
      out_BLKGH = telemetry.sow_max_logit(self, out_BLKGH)
    out_BLNH = out_BLKGH.reshape(B, L, N, H)
    out_BLD = Einsum((N, H, D), ("heads", "head_dim", "embed"), name="o", **kw)(
        "BLNH,NHD->BLD", out_BLNH)
    chex.assert_equal_shape([x_BLD, out_BLD])
    return out_BLD

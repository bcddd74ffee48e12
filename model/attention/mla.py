"""Multi-head latent attention (MLA; DeepSeek-V2 section 2.1, DeepSeek-V3).

Instead of sharing K/V heads (GQA), MLA compresses each token's keys and values
into one normalised latent c_A (kv_lora_rank wide) and up-projects it per head;
position enters only through P extra "decoupled" rope dims: per-head rotated
queries against ONE rotated key shared by all heads. The decode cache therefore
holds per token and layer only the latent and the shared rope key, one row of
Z = A + P values, whatever the number of heads.

Training expands the latent to per-head keys [nope | rope] and values and runs
the configured attention implementation (model/attention/impls.py) like GQA with
K = N. Decoding absorbs the up-projections instead (DeepSeek-V2 section 2.1.3):
q_nope . (W_k c) = (W_k^T q_nope) . c, so each query head becomes an A + P wide
query against the cached rows (MQA over the latent: K = 1, G = N), and the
weighted sum of latents is up-projected by W_v after the softmax. The cache is written
by model/attention/kv_cache.py, as GQA's. Both paths
compute the same function (tests/model/test_mla.py).

Legend letters beyond model/__init__.py's (this file only): Q query latent rank,
A kv latent rank, P rope dims, U value head dim, I = H + P (a query / key head),
Z = A + P (one cache row),
W = max(H + P, U) (the common q/k/v width handed to the shared implementations);
H is qk_nope_head_dim here.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from model import positional, telemetry
from model.attention import kv_cache
from model.attention.impls import layer_impl
from model.attention.reference import AttnData, spec_from_config
from model.config import LayerKind, ModelConfig
from model.layers import Einsum, Norm

LATENT_NORM_EPS = 1e-6  # DeepSeek's q_a / kv_a layernorms use their default eps.


@functools.lru_cache(maxsize=64)
def rope_config(cfg: ModelConfig) -> ModelConfig:
  """The config model/positional.py rotates MLA's rope dims with: head_dim = P, all rotated
  (HF computes DeepSeek's frequencies, YaRN's included, over head_dim = qk_rope_head_dim)."""
  return cfg.replace(attention_type="gqa", head_dim=cfg.mla_dims.qk_rope_head_dim,
                     rope_fraction=1.0, yarn_mscale_all_dim=0.0)


def mla_scale(cfg: ModelConfig) -> float:
  """Softmax scale: 1/sqrt(H + P), times DeepSeek's YaRN mscale(factor, mscale_all_dim)**2."""
  if cfg.attn_scale is not None:
    return cfg.attn_scale
  dims = cfg.mla_dims
  scale = (dims.qk_nope_head_dim + dims.qk_rope_head_dim) ** -0.5
  factor = cfg.rope_scaling_factor
  if cfg.rope_scaling == "yarn" and cfg.yarn_mscale_all_dim and factor > 1:
    mscale = 0.1 * cfg.yarn_mscale_all_dim * math.log(factor) + 1.0
    scale *= mscale * mscale
  return scale


class MLA(nn.Module):
  """Multi-head latent attention with its projections, decoupled RoPE and latent cache."""

  cfg: ModelConfig
  kind: LayerKind | None = None  # None: layer 0's.

  def _einsum(self, shape, axes, name, fan_in_rank=None, whole_in_stage=False):
    # A projection from a normalised (unit-RMS) latent of rank r gets std * sqrt(D / r): its
    # outputs start at the scale of a std-initialised projection of the (normed) residual
    # stream, i.e. of GQA's q / k / v, whatever the rank.
    cfg = self.cfg
    std = cfg.init_std * (math.sqrt(cfg.d_model / fan_in_rank) if fan_in_rank else 1.0)
    return Einsum(shape, axes, dtype=cfg.dtype, param_dtype=cfg.param_dtype, init_std=std,
                  whole_in_stage=whole_in_stage, name=name)

  def _latent_norm(self, name):
    cfg = self.cfg
    return Norm(kind=cfg.norm, eps=LATENT_NORM_EPS, axis_name="latent", dtype=cfg.dtype,
                param_dtype=cfg.param_dtype, name=name)

  @nn.compact
  def __call__(self, x_BLD: jax.Array, positions_BL: jax.Array, segment_ids_BL: jax.Array,
               decode: bool = False) -> jax.Array:
    cfg = self.cfg
    kind = self.kind or cfg.layer_kind(0)
    B, L, D = x_BLD.shape
    N = cfg.num_heads
    Q, A, H, P, U = cfg.mla_dims
    if Q:
      cq_BLQ = self._einsum((D, Q), ("embed", "latent"), "q_a", whole_in_stage=True)(
          "BLD,DQ->BLQ", x_BLD)
      cq_BLQ = checkpoint_name(self._latent_norm("q_a_norm")(cq_BLQ), "mla_q")
      q_nope_BLNH = self._einsum((Q, N, H), ("latent", "heads", "head_dim"), "q_nope", Q)(
          "BLQ,QNH->BLNH", cq_BLQ)
      q_rope_BLNP = self._einsum((Q, N, P), ("latent", "heads", "head_dim"), "q_rope", Q)(
          "BLQ,QNP->BLNP", cq_BLQ)
    else:
      q_nope_BLNH = self._einsum((D, N, H), ("embed", "heads", "head_dim"), "q_nope")(
          "BLD,DNH->BLNH", x_BLD)
      q_rope_BLNP = self._einsum((D, N, P), ("embed", "heads", "head_dim"), "q_rope")(
          "BLD,DNP->BLNP", x_BLD)
    c_BLA = self._einsum((D, A), ("embed", "latent"), "kv_a", whole_in_stage=True)(
        "BLD,DA->BLA", x_BLD)
    c_BLA = self._latent_norm("kv_a_norm")(c_BLA)
    c_BLA = nn.with_logical_constraint(c_BLA, ("batch", "length", "latent"))
    c_BLA = checkpoint_name(c_BLA, "mla_kv")  # model/remat.py's names, as MaxText's.
    k_rope_BL1P = self._einsum((D, P), ("embed", "head_dim"), "k_rope", whole_in_stage=True)(
        "BLD,DP->BLP", x_BLD)[:, :, None]
    if kind.rope:
      rcfg, seq_len = rope_config(cfg), jnp.max(positions_BL) + 1
      q_rope_BLNP = positional.apply_rope(q_rope_BLNP, positions_BL, rcfg, seq_len)
      k_rope_BL1P = positional.apply_rope(k_rope_BL1P, positions_BL, rcfg, seq_len)
    w_k_ANH = self._einsum((A, N, H), ("latent", "heads", "head_dim"), "k_up", A)
    w_v_ANU = self._einsum((A, N, U), ("latent", "heads", "head_dim"), "v_up", A)
    spec = dataclasses.replace(spec_from_config(cfg, kind.window), scale=mla_scale(cfg))
    if decode:
      out_BLNU = self._absorbed(q_nope_BLNH, q_rope_BLNP, c_BLA, k_rope_BL1P[:, :, 0],
                                w_k_ANH, w_v_ANU, segment_ids_BL, positions_BL, spec)
    else:
      out_BLNU = self._expanded(q_nope_BLNH, q_rope_BLNP, c_BLA, k_rope_BL1P, w_k_ANH,
                                w_v_ANU, segment_ids_BL, positions_BL, spec)
    out_BLNU = nn.with_logical_constraint(out_BLNU, ("batch", "length", "heads", "head_dim"))
    out_BLNU = checkpoint_name(out_BLNU, "context")
    out_BLD = self._einsum((N, U, D), ("heads", "head_dim", "embed"), "o")(
        "BLNU,NUD->BLD", out_BLNU)
    out_BLD = checkpoint_name(out_BLD, "out_proj")
    chex.assert_equal_shape([x_BLD, out_BLD])
    return out_BLD

  def _expanded(self, q_nope_BLNH, q_rope_BLNP, c_BLA, k_rope_BL1P, w_k_ANH, w_v_ANU,
                segment_ids_BL, positions_BL, spec):
    """Training / full forward: per-head keys and values, any attention implementation."""
    B, L, N, H = q_nope_BLNH.shape
    P, U = q_rope_BLNP.shape[-1], w_v_ANU.shape[-1]
    k_nope_BLNH = w_k_ANH("BLA,ANH->BLNH", c_BLA)
    v_BLNU = w_v_ANU("BLA,ANU->BLNU", c_BLA)
    q_BLNI = jnp.concatenate([q_nope_BLNH, q_rope_BLNP], axis=-1)
    k_BLNI = jnp.concatenate(
        [k_nope_BLNH, jnp.broadcast_to(k_rope_BL1P, (B, L, N, P)).astype(k_nope_BLNH.dtype)],
        axis=-1)
    # The implementations take one width for q, k and v: zeros pad the narrower (zero
    # query/key dims add nothing to a score, zero value dims are cut off after).
    W = max(H + P, U)
    pad = lambda x: jnp.pad(x, ((0, 0),) * 3 + ((0, W - x.shape[-1]),))
    q_BLNW = nn.with_logical_constraint(pad(q_BLNI), ("batch", "length", "heads", "head_dim"))
    k_BLNW = nn.with_logical_constraint(pad(k_BLNI), ("batch", "length", "heads", "head_dim"))
    v_BLNW = nn.with_logical_constraint(pad(v_BLNU), ("batch", "length", "heads", "head_dim"))
    q_BLNW = checkpoint_name(q_BLNW, "query_proj")
    k_BLNW = checkpoint_name(k_BLNW, "key_proj")
    v_BLNW = checkpoint_name(v_BLNW, "value_proj")
    data = AttnData(segment_ids_BL, segment_ids_BL, positions_BL, positions_BL)
    report = telemetry.enabled(self)
    attend_fn = layer_impl(self.cfg, L, decode=False, initializing=self.is_initializing(),
                           with_max=report)
    out_BLN1W = attend_fn(q_BLNW[:, :, :, None], k_BLNW, v_BLNW, data, spec)
    if report:
      out_BLN1W = telemetry.sow_max_logit(self, out_BLN1W)
    return out_BLN1W[:, :, :, 0, :U]

  def _absorbed(self, q_nope_BLNH, q_rope_BLNP, c_BLA, k_rope_BLP, w_k_ANH, w_v_ANU,
                segment_ids_BL, positions_BL, spec):
    """Decoding: W_k folded into the queries, W_v applied after the softmax; the cache holds
    one [A | P] row per token (MQA over the latent: one KV head, N query heads)."""
    A, dtype = c_BLA.shape[-1], c_BLA.dtype
    q_lat_BLNA = w_k_ANH("BLNH,ANH->BLNA", q_nope_BLNH)
    q_BL1NZ = jnp.concatenate([q_lat_BLNA, q_rope_BLNP.astype(dtype)], axis=-1)[:, :, None]
    row_BLZ = jnp.concatenate([c_BLA, k_rope_BLP.astype(dtype)], axis=-1)
    (row_BSZ,), data = kv_cache.write(self, ("cached_latent",), (row_BLZ,), segment_ids_BL,
                                      positions_BL, dtype=self.cfg.dtype)
    row_BS1Z = row_BSZ[:, :, None]
    # Values are the rows too: the latent part of the weighted sum is what W_v expands.
    attend_fn = layer_impl(self.cfg, q_BL1NZ.shape[1], decode=True,
                           initializing=self.is_initializing())
    out_BL1NZ = attend_fn(q_BL1NZ, row_BS1Z, row_BS1Z, data, spec)
    ctx_BLNA = out_BL1NZ[:, :, 0, :, :A]
    return w_v_ANU("BLNA,ANU->BLNU", ctx_BLNA)

"""The attention-score hook: every mask and score bias, written once for every implementation.

An implementation computes raw scores s = scale * q.k (float32) for some (query, key)
pairs, a `Tile`: the whole call for the reference and cuDNN, one block pair inside
blockwise's loop (a ring step's key shard, for context parallelism). `logits(spec, s,
tile)` turns them into what the softmax takes, in one order for all: the soft-cap, every
active bias of BIASES, then the mask (causal, sliding window, segment ids). The vendor
kernels build their own arguments from the same spec (model/attention/kernels.py) and
refuse by name what they cannot express (`kernels.kernel_gaps`).

Adding an attention-score bias (docs/model.md, "Adding an attention-score bias"): a switch
in AttnSpec, the line of `spec_from_config` that reads it from its ModelConfig field (and
the field itself, model/config.py), and an entry in BIASES. The entry computes a float32
bias from the tile's positions, slots or segment ids; it is not a function of q, k or of
parameters, so blockwise's backward treats it as a constant. The reference, blockwise and
cuDNN (as a dense bias) then add it; Splash refuses it, naming `source`.

Masks follow slots (the order of tokens in the sequence or the cache), never positions;
`visible_kv_slots` / `visible_q_slots` say which slots the causal and window masks can
reach, so a blocked implementation skips the rest.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

NEG_INF = -1e30  # Finite: a fully masked row gives a uniform softmax, not NaN.


@dataclasses.dataclass(frozen=True)
class AttnSpec:
  """Static attention choices, hashable (a custom_vjp / jit static argument)."""
  scale: float
  softcap: float = 0.0  # 0: off; else cap * tanh(logits / cap).
  sliding_window: int = 0  # 0: full causal; else q_slot - kv_slot < window.
  alibi: bool = False  # Per-head linear bias from positions (alibi_slopes).
  block_q: int = 0  # Blocked implementations only; 0: sized from the shapes.
  block_kv: int = 0


def spec_from_config(cfg, sliding_window: int | None = None) -> AttnSpec:
  """The AttnSpec of a ModelConfig, for a layer of `sliding_window` (None: the config's;
  a layer's own is ModelConfig.layer_kind(i).window)."""
  H = cfg.resolved_head_dim
  window = cfg.sliding_window if sliding_window is None else sliding_window
  return AttnSpec(scale=cfg.attn_scale if cfg.attn_scale is not None else H ** -0.5,
                  softcap=cfg.attn_logit_softcap, sliding_window=window,
                  alibi=cfg.pos_encoding == "alibi", block_q=cfg.attention_block_q,
                  block_kv=cfg.attention_block_kv)


class Tile(NamedTuple):
  """The (query, key) pairs one score computation covers (B batch, L queries, S keys)."""
  q_slots_L: jax.Array
  kv_slots_S: jax.Array
  q_segment_ids_BL: jax.Array  # Packed documents; 0 = padding. Never attend across ids.
  kv_segment_ids_BS: jax.Array
  q_positions_BL: jax.Array | None = None  # Feed position biases (ALiBi) only.
  kv_positions_BS: jax.Array | None = None


# Masks -----------------------------------------------------------------------


def mask_BLS(spec: AttnSpec, tile: Tile) -> jax.Array:
  """Boolean mask_BLS: True where query l may attend to key s."""
  q_L, kv_S = tile.q_slots_L, tile.kv_slots_S
  causal_LS = kv_S[None, :] <= q_L[:, None]
  if spec.sliding_window:
    causal_LS &= q_L[:, None] - kv_S[None, :] < spec.sliding_window
  same_doc_BLS = tile.q_segment_ids_BL[:, :, None] == tile.kv_segment_ids_BS[:, None, :]
  return causal_LS[None] & same_doc_BLS


def visible_kv_slots(spec: AttnSpec, q_first, q_last):
  """[first, last] key slots that queries q_first..q_last can see (causal, window)."""
  first = jnp.maximum(q_first - spec.sliding_window + 1, 0) if spec.sliding_window else 0
  return first, q_last


def visible_q_slots(spec: AttnSpec, kv_first, kv_last):
  """[first, last] query slots that can see keys kv_first..kv_last; last None: unbounded."""
  last = kv_last + spec.sliding_window - 1 if spec.sliding_window else None
  return kv_first, last


# Biases ----------------------------------------------------------------------


def alibi_slopes(num_heads: int) -> np.ndarray:
  """Press et al. (2022) head slopes, [N] float32.

  For N a power of two: 2**(-8/N), its powers up to 2**-8. Otherwise the
  slopes of the nearest smaller power of two P, then every other slope of 2P
  for the remaining N - P heads (the paper's reference code).
  """
  if not isinstance(num_heads, (int, np.integer)) or num_heads < 1:
    raise ValueError(f"alibi_slopes: num_heads={num_heads!r} must be a positive integer")

  def power_of_two(n: int) -> list[float]:
    start = 2.0 ** (-8.0 / n)
    return [start ** (i + 1) for i in range(n)]

  p = 2 ** int(math.floor(math.log2(num_heads)))
  slopes = power_of_two(p)
  if p < num_heads:
    slopes += power_of_two(2 * p)[0::2][:num_heads - p]
  return np.asarray(slopes, np.float32)


def alibi_bias(q_positions_BL: jax.Array, kv_positions_BS: jax.Array,
               num_heads: int) -> jax.Array:
  """bias_BNLS = -slope_n * (q_pos - kv_pos), float32, added to attention logits.

  Signed distance, as the causal ALiBi reference: past keys get a penalty
  growing with distance; future keys (q_pos < kv_pos) get a positive bias and
  must be removed by the causal mask, which every ALiBi model applies anyway.
  """
  chex.assert_rank([q_positions_BL, kv_positions_BS], 2)
  if q_positions_BL.shape[0] != kv_positions_BS.shape[0]:
    raise ValueError(f"alibi_bias: batch of q positions {q_positions_BL.shape} != "
                     f"kv positions {kv_positions_BS.shape}")
  # Subtract in integers first: exact distances even at large absolute positions.
  dist_BLS = (q_positions_BL[:, :, None] - kv_positions_BS[:, None, :]).astype(jnp.float32)
  slopes_N = jnp.asarray(alibi_slopes(num_heads))
  return -slopes_N[None, :, None, None] * dist_BLS[:, None, :, :]


def _alibi_BKGLS(spec: AttnSpec, tile: Tile, K: int, G: int) -> jax.Array:
  del spec
  (B, L), S = tile.q_positions_BL.shape, tile.kv_positions_BS.shape[1]
  return alibi_bias(tile.q_positions_BL, tile.kv_positions_BS, K * G).reshape(B, K, G, L, S)


class ScoreBias(NamedTuple):
  field: str  # The AttnSpec switch that turns it on.
  source: str  # The config setting behind the switch, for error messages.
  bias_BKGLS: Callable[[AttnSpec, Tile, int, int], jax.Array]  # (spec, tile, K, G).


BIASES = (ScoreBias("alibi", "pos_encoding='alibi'", _alibi_BKGLS),)


def active_biases(spec: AttnSpec) -> tuple[ScoreBias, ...]:
  return tuple(b for b in BIASES if getattr(spec, b.field))


def bias_BKGLS(spec: AttnSpec, tile: Tile, K: int, G: int) -> jax.Array | None:
  """The sum of the spec's active biases over the tile, float32; None without one."""
  total = None
  for bias in active_biases(spec):
    term = bias.bias_BKGLS(spec, tile, K, G)
    total = term if total is None else total + term
  return total


# Scores -> logits --------------------------------------------------------------


def modify(s_BKGLS: jax.Array, mask_BLS: jax.Array, *, softcap: float = 0.0,
           bias_BKGLS: jax.Array | None = None):
  """(logits_BKGLS, dlogits_BKGLS): soft-cap, bias and mask applied to scaled scores.

  dlogits (None without a soft-cap) is d logits / d s where unmasked: what a
  hand-written backward (blockwise's) multiplies the score gradient by.
  """
  dlogits_BKGLS = None
  if softcap:
    tanh_BKGLS = jnp.tanh(s_BKGLS / softcap)
    s_BKGLS = softcap * tanh_BKGLS
    dlogits_BKGLS = 1.0 - tanh_BKGLS * tanh_BKGLS
  if bias_BKGLS is not None:
    s_BKGLS = s_BKGLS + bias_BKGLS
  return jnp.where(mask_BLS[:, None, None], s_BKGLS, NEG_INF), dlogits_BKGLS


def logits(spec: AttnSpec, s_BKGLS: jax.Array, tile: Tile):
  """`modify` with the spec's soft-cap, biases and mask over `tile`."""
  _, K, G, _, _ = s_BKGLS.shape
  return modify(s_BKGLS, mask_BLS(spec, tile), softcap=spec.softcap,
                bias_BKGLS=bias_BKGLS(spec, tile, K, G))

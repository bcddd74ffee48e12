"""What every attention implementation takes, and the reference ("xla") one.

An implementation is `fn(q_BLKGH, k_BSKH, v_BSKH, data, spec) -> out_BLKGH`:
`data` holds the per-token arrays (segment ids, positions, the first query's
slot), `spec` the static choices read once from the config. Query heads stay
grouped by their KV head, so K/V are never repeated to N heads.

The reference materialises float32 scores_BKGLS, a mask_BLS and, for ALiBi, a
bias_BKGLS. It is the simplest path and the only one that serves decoding
(queries at a cache offset); the others (model/attention/blockwise.py,
model/attention/kernels.py) must equal it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import chex
import jax
import jax.numpy as jnp

from model import mup, positional

NEG_INF = -1e30  # Finite: a fully masked row gives a uniform softmax, not NaN.


class AttnData(NamedTuple):
  """Per-token inputs of one attention call (B batch, L queries, S keys)."""
  q_segment_ids_BL: jax.Array  # Packed documents; 0 = padding. Never attend across ids.
  kv_segment_ids_BS: jax.Array
  q_positions_BL: jax.Array  # Feed ALiBi only; masks follow slots.
  kv_positions_BS: jax.Array
  # Slot of the first query when decoding (the cache index); None: slot i is token i.
  q_start: jax.Array | None = None
  # Slot of each key when decoding from a ring buffer (a local layer's cache); None: key s
  # is slot s.
  kv_slots_S: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class AttnSpec:
  """Static attention choices, hashable (a custom_vjp / jit static argument)."""
  scale: float
  softcap: float = 0.0  # 0: off; else cap * tanh(logits / cap).
  sliding_window: int = 0  # 0: full causal; else q_slot - kv_slot < window.
  alibi: bool = False  # Per-head linear bias from positions (positional.alibi_slopes).
  block_q: int = 0  # Blocked implementations only; 0: sized from the shapes.
  block_kv: int = 0


def spec_from_config(cfg, sliding_window: int | None = None) -> AttnSpec:
  """The AttnSpec of a ModelConfig, for a layer of `sliding_window` (None: the config's;
  a layer's own is ModelConfig.layer_kind(i).window)."""
  window = cfg.sliding_window if sliding_window is None else sliding_window
  return AttnSpec(scale=mup.softmax_scale(cfg),  # attn_scale, else 1/sqrt(H) (µP: 1/H)
                  softcap=cfg.attn_logit_softcap, sliding_window=window,
                  alibi=cfg.pos_encoding == "alibi", block_q=cfg.attention_block_q,
                  block_kv=cfg.attention_block_kv)


AttendFn = Callable[[jax.Array, jax.Array, jax.Array, AttnData, AttnSpec], jax.Array]


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


def xla_attention(q_BLKGH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, data: AttnData,
                  spec: AttnSpec) -> jax.Array:
  """The reference: the whole mask and score matrix at once (einsums, any backend)."""
  B, L, K, G, _ = q_BLKGH.shape
  S = k_BSKH.shape[1]
  q_slots_L = jnp.arange(L) if data.q_start is None else jnp.arange(L) + data.q_start
  kv_slots_S = jnp.arange(S) if data.kv_slots_S is None else data.kv_slots_S
  chex.assert_shape(kv_slots_S, (S,))
  mask_BLS = make_mask(q_slots_L, kv_slots_S, data.q_segment_ids_BL,
                       data.kv_segment_ids_BS, spec.sliding_window)
  bias_BKGLS = None
  if spec.alibi:
    bias_BNLS = positional.alibi_bias(data.q_positions_BL, data.kv_positions_BS, K * G)
    bias_BKGLS = bias_BNLS.reshape(B, K, G, L, S)
  return attend(q_BLKGH, k_BSKH, v_BSKH, mask_BLS, scale=spec.scale, softcap=spec.softcap,
                bias_BKGLS=bias_BKGLS)


def check_self_attention(name: str, q_BLKGH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array,
                         data: AttnData):
  """The non-reference paths attend over the call's own tokens (slot i = token i)."""
  B, L, K, _, H = q_BLKGH.shape
  if k_BSKH.shape[1] != L or data.q_start is not None or data.kv_slots_S is not None:
    raise ValueError(f"attention_impl={name!r} serves self-attention over the whole sequence "
                     f"(L == S, no cache offset); got L={L}, S={k_BSKH.shape[1]}. Decoding "
                     "uses 'xla'.")
  chex.assert_shape([k_BSKH, v_BSKH], (B, L, K, H))
  chex.assert_shape([data.q_segment_ids_BL, data.kv_segment_ids_BS, data.q_positions_BL,
                     data.kv_positions_BS], (B, L))

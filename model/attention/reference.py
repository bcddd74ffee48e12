"""What every attention implementation takes, and the reference ("xla") one.

An implementation is `fn(q_BLKGH, k_BSKH, v_BSKH, data, spec) -> out_BLKGH`:
`data` holds the per-token arrays (segment ids, positions, the first query's
slot), `spec` the static choices read once from the config. Query heads stay
grouped by their KV head, so K/V are never repeated to N heads.

The reference materialises float32 scores_BKGLS, a mask_BLS and, for ALiBi, a
bias_BKGLS, all from the score hook (model/attention/scores.py). It is the simplest
path and the only one that serves decoding (queries at a cache offset); the others
(model/attention/blockwise.py, model/attention/kernels.py) must equal it.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import chex
import jax
import jax.numpy as jnp

from model.attention import scores
from model.attention.scores import NEG_INF, AttnSpec, spec_from_config  # noqa: F401  (re-exported)


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


AttendFn = Callable[[jax.Array, jax.Array, jax.Array, AttnData, AttnSpec], jax.Array]


def whole_tile(data: AttnData, L: int, S: int) -> scores.Tile:
  """The score hook's tile of a whole call: every query against every key, at their slots."""
  q_slots_L = jnp.arange(L) if data.q_start is None else jnp.arange(L) + data.q_start
  kv_slots_S = jnp.arange(S) if data.kv_slots_S is None else data.kv_slots_S
  chex.assert_shape(kv_slots_S, (S,))
  return scores.Tile(q_slots_L, kv_slots_S, data.q_segment_ids_BL, data.kv_segment_ids_BS,
                     data.q_positions_BL, data.kv_positions_BS)


def make_mask(q_slots_L: jax.Array, kv_slots_S: jax.Array, q_segment_ids_BL: jax.Array,
              kv_segment_ids_BS: jax.Array, sliding_window: int = 0) -> jax.Array:
  """Boolean mask_BLS: True where query l may attend to key s (scores.mask_BLS)."""
  return scores.mask_BLS(AttnSpec(scale=1.0, sliding_window=sliding_window),
                         scores.Tile(q_slots_L, kv_slots_S, q_segment_ids_BL, kv_segment_ids_BS))


def attend(q_BLKGH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, mask_BLS: jax.Array,
           *, scale: float, softcap: float = 0.0, bias_BKGLS: jax.Array | None = None,
           return_max: bool = False):
  """Scaled dot-product attention over grouped heads; softmax in float32. return_max:
  (out, the largest unmasked logit: after soft-cap and biases, before the softmax)."""
  B, L, K, G, H = q_BLKGH.shape
  S = k_BSKH.shape[1]
  chex.assert_shape([k_BSKH, v_BSKH], (B, S, K, H))
  chex.assert_shape(mask_BLS, (B, L, S))
  s_BKGLS = jnp.einsum("BLKGH,BSKH->BKGLS", q_BLKGH, k_BSKH,
                       preferred_element_type=jnp.float32) * scale
  logits_BKGLS, _ = scores.modify(s_BKGLS, mask_BLS, softcap=softcap, bias_BKGLS=bias_BKGLS)
  probs_BKGLS = jax.nn.softmax(logits_BKGLS, axis=-1).astype(v_BSKH.dtype)
  out_BLKGH = jnp.einsum("BKGLS,BSKH->BLKGH", probs_BKGLS, v_BSKH,
                         preferred_element_type=jnp.float32).astype(v_BSKH.dtype)
  if not return_max:
    return out_BLKGH
  # Masked logits are NEG_INF, below every real one: the rows' max is the softmax's own
  # (XLA computes it once), and the max over rows is the unmasked maximum.
  return out_BLKGH, jax.lax.stop_gradient(jnp.max(jnp.max(logits_BKGLS, axis=-1)))


def xla_attention(q_BLKGH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, data: AttnData,
                  spec: AttnSpec, return_max: bool = False):
  """The reference: the whole mask and score matrix at once (einsums, any backend).
  return_max: (out, max logit), as `attend`."""
  _, L, K, G, _ = q_BLKGH.shape
  tile = whole_tile(data, L, k_BSKH.shape[1])
  return attend(q_BLKGH, k_BSKH, v_BSKH, scores.mask_BLS(spec, tile), scale=spec.scale,
                softcap=spec.softcap, bias_BKGLS=scores.bias_BKGLS(spec, tile, K, G),
                return_max=return_max)


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

"""The one KV-cache writer of the attention layers: GQA's global and local layers, and MLA.

A layer hands `write` the arrays it caches per token ([B, L, ...]: GQA's keys and values,
MLA's latent rows) with their cache names; the writer keeps them, with the tokens'
segment ids and positions and a write index, in the layer's "cache" collection, and
returns what the call attends over plus the AttnData that says where its queries and
keys sit. The cache is sized by the first call (the `init` of decoding, with a
[B, S_max] dummy input); model/decode/cache.py reads its shapes.

A global cache (window 0) holds every slot: [B, S_max, ...]; the call's entries are
written at the index and the whole cache is returned. A local layer's (window > 0) is a
ring of min(window, S_max) slots, slot s in entry s % (the ring's size): the call's queries attend
over the ring's entries and the call's own keys, concatenated (writing first would let a
prompt longer than the ring overwrite keys its first queries need); then the newest
entries, as many as the ring holds, are written. The mask follows slots, so the ring returns each key's slot.
"""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from model.attention.reference import AttnData


def write(module: nn.Module, names: tuple[str, ...], new: tuple[jax.Array, ...],
          segment_ids_BL: jax.Array, positions_BL: jax.Array, *, dtype,
          window: int = 0) -> tuple[tuple[jax.Array, ...], AttnData]:
  """Caches `new` (each [B, L, ...], stored in `dtype`) under `names`; returns (the cached
  arrays to attend over, each [B, S, ...], and the call's AttnData)."""
  B, L = segment_ids_BL.shape
  is_init = not module.has_variable("cache", names[0])
  S = min(window, L) if window else L  # The first call's length is S_max.
  arrays = [module.variable("cache", name, jnp.zeros, (B, S) + x.shape[2:], jnp.dtype(dtype))
            for name, x in zip(names, new)]
  arrays.append(module.variable("cache", "segment_ids", jnp.zeros, (B, S), jnp.int32))
  arrays.append(module.variable("cache", "positions", jnp.zeros, (B, S), jnp.int32))
  idx_var = module.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
  news = (*new, segment_ids_BL, positions_BL)
  if is_init:
    return tuple(new), AttnData(segment_ids_BL, segment_ids_BL, positions_BL, positions_BL,
                                jnp.zeros((), jnp.int32))
  start = idx_var.value
  if window:
    out, kv_slots_S = _ring(arrays, news, start)
  else:
    out, kv_slots_S = _at_index(arrays, news, start), None
  idx_var.value = start + L
  *cached, kv_segment_ids_BS, kv_positions_BS = out
  return tuple(cached), AttnData(segment_ids_BL, kv_segment_ids_BS, positions_BL,
                                 kv_positions_BS, start, kv_slots_S)


def _at_index(variables, news, start):
  """A global cache: the call's L entries written at `start`; the whole cache returned."""
  out = []
  for var, x in zip(variables, news):
    var.value = jax.lax.dynamic_update_slice_in_dim(var.value, x.astype(var.value.dtype),
                                                    start, axis=1)
    out.append(var.value)
  return out


def _ring(variables, news, start):
  """A ring of `size` entries: returns (its entries + the call's, [B, size + L, ...]; the
  slot of each). No shape letter for the ring: R is experts per token (model/__init__.py)."""
  B, L = news[-1].shape
  size = variables[0].value.shape[1]
  # Entry r holds the newest slot s < start with s % size == r; a negative s was never
  # written (segment 0: no real query attends to it).
  ring_slots = start - 1 - jnp.mod(start - 1 - jnp.arange(size), size)
  kv_slots_S = jnp.concatenate([ring_slots, start + jnp.arange(L)])
  m = min(L, size)  # Distinct entries: only the last `size` of a longer chunk are kept.
  entries = jnp.mod(start + L - m + jnp.arange(m), size)
  out = []
  for var, x in zip(variables, news):
    x = x.astype(var.value.dtype)
    out.append(jnp.concatenate([var.value, x], axis=1))
    var.value = var.value.at[:, entries].set(x[:, L - m:])
  chex.assert_shape(out[-1], (B, size + L))
  return out, kv_slots_S

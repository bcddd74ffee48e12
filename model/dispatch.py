"""MoE dispatch strategies: routed tokens -> expert FFNs -> gate-weighted sum.

One function per strategy, all with the signature of `Dispatch`, chosen once from
`ModelConfig.moe_dispatch` through `DISPATCH`:

  capacity         one-hot dispatch / combine einsums into fixed buffers x_EBCD.
  dropless         pairs sorted by expert + `jax.lax.ragged_dot`; nothing is dropped.
  expert_parallel  the capacity computation with experts sharded over the mesh's
                   "expert" axis (parallel/expert.py); identical numbers.
  expert_parallel_ragged
                   the dropless computation with experts sharded over the "expert"
                   axis, rows moved by jax.lax.ragged_all_to_all (GPU / TPU only).

Routing groups and capacity. A routing group is ONE SEQUENCE (T = L): the expert
capacity is C = min(L, ceil(R * L * capacity_factor / E)), and capacity_factor 0 means
C = L, which can never drop (a token picks an expert at most once). Per-sequence groups
keep a sequence's output independent of the rest of the batch, shard along the batch
without communication, match the per-device buffers of expert parallelism exactly,
and make single-token decoding (L = 1, so C = 1) drop nothing whatever the factor.
The price is one-hot buffers that grow as L^2 per sequence (dispatch_BLEC): for long
sequences use "dropless" or expert parallelism across devices.

Priority inside a group: every token's first choice is queued before any second
choice, and within one rank earlier tokens come first. A pair that finds its
expert's buffer full is dropped: it contributes zero, and the token still passes
through the residual connection (and any shared experts).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from model.router import Routing
from parallel import expert as ep_lib


class ExpertWeights(NamedTuple):
  wi_EDF: jax.Array
  wg_EDF: jax.Array | None  # Gated FFNs (swiglu, geglu) only.
  wo_EFD: jax.Array


# (x_BLD, routing, weights, ffn kind, capacity factor) -> (y_BLD, fraction of pairs dropped)
Dispatch = Callable[[jax.Array, Routing, ExpertWeights, str, float],
                    tuple[jax.Array, jax.Array]]


def capacity(length: int, num_selected: int, num_experts: int, factor: float) -> int:
  """C = min(L, ceil(R * L * factor / E)) per sequence; factor 0: C = L (no drops)."""
  if factor <= 0:
    return length
  # round(): 2 * 10 * 1.2 / 4 is 6.000000000000001 in floating point, not 7 slots.
  return min(length, max(1, math.ceil(round(num_selected * length * factor / num_experts, 9))))


def activate(h: jax.Array, gate: jax.Array | None, ffn: str) -> jax.Array:
  """The FFN nonlinearity (same choices as layers.FeedForward), in float32."""
  h = h.astype(jnp.float32)
  if ffn in ("swiglu", "geglu"):
    return (nn.silu if ffn == "swiglu" else nn.gelu)(gate.astype(jnp.float32)) * h
  return nn.gelu(h) if ffn == "gelu" else nn.relu(h)


def expert_ffn(x_EBCD: jax.Array, w: ExpertWeights, ffn: str) -> jax.Array:
  """Every expert e applied to its buffers x_EBCD[e]; float32 accumulation.

  Expert-major buffers: that is the layout expert parallelism shards, and XLA:CPU
  cannot run the bf16 x bf16 -> f32 batched dot it picks for a B-major "BECD,EDF".
  """
  dot = lambda eqn, a, b: jnp.einsum(eqn, a, b, preferred_element_type=jnp.float32)
  h_EBCF = dot("EBCD,EDF->EBCF", x_EBCD, w.wi_EDF)
  g_EBCF = None if w.wg_EDF is None else dot("EBCD,EDF->EBCF", x_EBCD, w.wg_EDF)
  h_EBCF = activate(h_EBCF, g_EBCF, ffn).astype(x_EBCD.dtype)
  return dot("EBCF,EFD->EBCD", h_EBCF, w.wo_EFD).astype(x_EBCD.dtype)


def capacity_masks(indices_BLR: jax.Array, gates_BLR: jax.Array, num_experts: int,
                   cap: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """dispatch_BLEC (0/1), combine_BLEC (gates) and kept_B (pairs kept per sequence)."""
  B, L, R = indices_BLR.shape
  expert_BRLE = jax.nn.one_hot(indices_BLR.transpose(0, 2, 1), num_experts, dtype=jnp.int32)
  # Rank-major queue: all first choices of the sequence, then all second choices, ...
  queue = expert_BRLE.reshape(B, R * L, num_experts)
  slot_BRLE = (jnp.cumsum(queue, axis=1) - 1).reshape(B, R, L, num_experts)
  slot_BRL = (slot_BRLE * expert_BRLE).sum(-1)
  # one_hot of a slot >= cap is an all-zero row: the pair is dropped.
  slot_BRLC = jax.nn.one_hot(slot_BRL, cap, dtype=jnp.float32)
  expert_BRLE = expert_BRLE.astype(jnp.float32)
  dispatch_BLEC = jnp.einsum("BRLE,BRLC->BLEC", expert_BRLE, slot_BRLC)
  combine_BLEC = jnp.einsum("BRLE,BRLC,BRL->BLEC", expert_BRLE, slot_BRLC,
                            gates_BLR.transpose(0, 2, 1).astype(jnp.float32))
  kept_B = (slot_BRL < cap).sum((1, 2))
  return dispatch_BLEC, combine_BLEC, kept_B


def _capacity_compute(x_BLD: jax.Array, indices_BLR: jax.Array, gates_BLR: jax.Array,
                      w: ExpertWeights, ffn: str, num_experts: int, cap: int,
                      to_experts=lambda x: x, from_experts=lambda y: y):
  """(y_BLD, kept_B) on local rows; expert parallelism passes its all_to_all as
  `to_experts` / `from_experts` (and then holds only its share of `w`)."""
  dtype = x_BLD.dtype
  dispatch_BLEC, combine_BLEC, kept_B = capacity_masks(indices_BLR, gates_BLR, num_experts, cap)
  x_EBCD = jnp.einsum("BLD,BLEC->EBCD", x_BLD, dispatch_BLEC.astype(dtype))
  y_EBCD = from_experts(expert_ffn(to_experts(x_EBCD), w, ffn))
  chex.assert_equal_shape([x_EBCD, y_EBCD])
  y_BLD = jnp.einsum("EBCD,BLEC->BLD", y_EBCD, combine_BLEC.astype(dtype),
                     preferred_element_type=jnp.float32)
  return y_BLD.astype(dtype), kept_B


def _dropped_frac(kept_B: jax.Array, pairs: int) -> jax.Array:
  # Integer count first: 1 - kept / pairs can come out as -3e-8 when nothing is dropped.
  return (pairs - kept_B.sum()).astype(jnp.float32) / pairs


def _shapes(x_BLD: jax.Array, routing: Routing, w: ExpertWeights) -> tuple[int, ...]:
  B, L, D = x_BLD.shape
  E, R = w.wi_EDF.shape[0], routing.indices_BLR.shape[-1]
  chex.assert_shape([routing.indices_BLR, routing.gates_BLR], (B, L, R))
  chex.assert_shape(w.wo_EFD, (E, None, D))
  return B, L, D, E, R


def capacity_dispatch(x_BLD: jax.Array, routing: Routing, w: ExpertWeights, ffn: str,
                      capacity_factor: float) -> tuple[jax.Array, jax.Array]:
  B, L, _, E, R = _shapes(x_BLD, routing, w)
  cap = capacity(L, R, E, capacity_factor)
  y_BLD, kept_B = _capacity_compute(x_BLD, routing.indices_BLR, routing.gates_BLR, w, ffn,
                                    E, cap)
  return y_BLD, _dropped_frac(kept_B, B * L * R)


def _sort_pairs(x_BLD: jax.Array, indices_BLR: jax.Array, num_experts: int):
  """(x_sorted [B*L*R, D] grouped by expert, the sort order, group_sizes_E)."""
  B, L, D = x_BLD.shape
  R = indices_BLR.shape[-1]
  expert_of_pair = indices_BLR.reshape(B * L * R)  # pair p is token p // R.
  order = jnp.argsort(expert_of_pair, stable=True)
  x_sorted = x_BLD.reshape(B * L, D)[order // R]
  return x_sorted, order, jnp.bincount(expert_of_pair, length=num_experts).astype(jnp.int32)


def _ragged_ffn(x_sorted: jax.Array, group_sizes: jax.Array, w: ExpertWeights,
                ffn: str) -> jax.Array:
  """Rows grouped by expert (rows past sum(group_sizes) come out as 0) -> float32 outputs."""
  dtype = x_sorted.dtype
  dot = lambda a, b: jax.lax.ragged_dot(a, b.astype(dtype), group_sizes,
                                        preferred_element_type=jnp.float32)
  h_sorted = dot(x_sorted, w.wi_EDF)
  g_sorted = None if w.wg_EDF is None else dot(x_sorted, w.wg_EDF)
  return dot(activate(h_sorted, g_sorted, ffn).astype(dtype), w.wo_EFD)


def _unsort_combine(y_sorted: jax.Array, order: jax.Array, gates_BLR: jax.Array,
                    dtype) -> jax.Array:
  B, L, R = gates_BLR.shape
  y_BLRD = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(B, L, R, -1)
  return jnp.einsum("BLRD,BLR->BLD", y_BLRD, gates_BLR).astype(dtype)


def dropless_dispatch(x_BLD: jax.Array, routing: Routing, w: ExpertWeights, ffn: str,
                      capacity_factor: float) -> tuple[jax.Array, jax.Array]:
  """Pairs sorted by expert, one ragged matmul per weight; capacity_factor is unused
  (ModelConfig requires 0). The sort spans the whole batch, so under data parallelism
  GSPMD gathers it: this is the single-device / small-scale path."""
  del capacity_factor
  _, _, _, E, _ = _shapes(x_BLD, routing, w)
  x_sorted, order, group_sizes_E = _sort_pairs(x_BLD, routing.indices_BLR, E)
  y_sorted = _ragged_ffn(x_sorted, group_sizes_E, w, ffn)
  y_BLD = _unsort_combine(y_sorted, order, routing.gates_BLR, x_BLD.dtype)
  return y_BLD, jnp.zeros((), jnp.float32)


def _check_expert_parallel(B: int, E: int, ep: int, name: str) -> None:
  if E % ep:
    raise ValueError(f"ModelConfig.num_experts={E}: must be divisible by the mesh's "
                     f"expert axis size {ep} for moe_dispatch='{name}'")
  if B % ep:
    raise ValueError(f"batch size {B} must be divisible by the mesh's expert axis size "
                     f"{ep} for moe_dispatch='{name}'")


def expert_parallel_dispatch(x_BLD: jax.Array, routing: Routing, w: ExpertWeights, ffn: str,
                             capacity_factor: float) -> tuple[jax.Array, jax.Array]:
  """The capacity computation, experts sharded over the context mesh's "expert" axis.

  With no mesh in context (e.g. `init` outside a mesh) or an expert axis of size 1 it
  is the local capacity computation, which gives the same numbers.
  """
  B, L, _, E, R = _shapes(x_BLD, routing, w)
  ep = ep_lib.expert_axis_size()
  cap = capacity(L, R, E, capacity_factor)
  if ep == 1:
    return capacity_dispatch(x_BLD, routing, w, ffn, capacity_factor)
  _check_expert_parallel(B, E, ep, "expert_parallel")

  def local(x_BLD, indices_BLR, gates_BLR, w):
    return _capacity_compute(x_BLD, indices_BLR, gates_BLR, w, ffn, E, cap,
                             ep_lib.to_experts, ep_lib.from_experts)

  y_BLD, kept_B = ep_lib.shard_over_experts(
      local, (x_BLD, routing.indices_BLR, routing.gates_BLR), (w,))
  return y_BLD, _dropped_frac(kept_B, B * L * R)


def expert_parallel_ragged_dispatch(x_BLD: jax.Array, routing: Routing, w: ExpertWeights,
                                    ffn: str, capacity_factor: float,
                                    collective: ep_lib.RaggedCollective | None = None
                                    ) -> tuple[jax.Array, jax.Array]:
  """Dropless expert parallelism (MaxText's ragged all-to-all design): each device sorts
  its pairs by expert, `ragged_all_to_all` sends every expert's rows to its device, the
  local experts run as one ragged matmul, and the outputs return the same way.

  The numbers of "dropless". `collective` defaults to `jax.lax.ragged_all_to_all`
  (GPU / TPU only; a clear error on CPU); tests pass a stand-in with its semantics.
  With no mesh or an expert axis of size 1 it is the local "dropless" computation.
  """
  B, L, _, E, R = _shapes(x_BLD, routing, w)
  ep = ep_lib.expert_axis_size()
  if ep == 1:
    return dropless_dispatch(x_BLD, routing, w, ffn, capacity_factor)
  _check_expert_parallel(B, E, ep, "expert_parallel_ragged")
  collective = collective or ep_lib.ragged_collective()
  E_local = E // ep
  pairs = B // ep * L * R  # per device
  # Receive buffer for the worst case: all devices' pairs for this device's experts (a
  # token picks an expert at most once, so at most min(R, E_local) of its R pairs).
  rows = B * L * min(R, E_local)

  def local(x_BLD, indices_BLR, gates_BLR, w):
    x_sorted, order, group_sizes_E = _sort_pairs(x_BLD, indices_BLR, E)
    x_recv, route = ep_lib.ragged_to_experts(x_sorted, group_sizes_E, rows,
                                             collective=collective)
    # Received rows come grouped by source device, then local expert: regroup them by
    # local expert for the ragged matmul (the padding rows form a last, unused group).
    counts = route.local_sizes_SX.reshape(-1)
    expert_of_row = jnp.repeat(
        jnp.append(jnp.tile(jnp.arange(E_local), ep), E_local),
        jnp.append(counts, rows - counts.sum()), total_repeat_length=rows)
    local_order = jnp.argsort(expert_of_row, stable=True)
    y_local = _ragged_ffn(x_recv[local_order], route.local_sizes_SX.sum(0), w, ffn)
    # Back in the compute dtype: half the bytes on the wire under bfloat16.
    y_local = y_local.astype(x_BLD.dtype)
    y_recv = jnp.zeros_like(y_local).at[local_order].set(y_local)
    y_sorted = ep_lib.ragged_from_experts(y_recv, route, pairs, collective=collective)
    return _unsort_combine(y_sorted, order, gates_BLR, x_BLD.dtype)

  y_BLD = ep_lib.shard_over_experts(local, (x_BLD, routing.indices_BLR, routing.gates_BLR),
                                    (w,))
  return y_BLD, jnp.zeros((), jnp.float32)


DISPATCH: dict[str, Dispatch] = {
    "capacity": capacity_dispatch,
    "dropless": dropless_dispatch,
    "expert_parallel": expert_parallel_dispatch,
    "expert_parallel_ragged": expert_parallel_ragged_dispatch,
}

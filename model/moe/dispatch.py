"""MoE dispatch strategies: routed tokens -> expert FFNs -> gate-weighted sum.

One function per strategy, all with the signature of `Dispatch`, chosen once from
`ModelConfig.moe_dispatch` through `DISPATCH`:

  capacity_einsum  one-hot dispatch / combine einsums into fixed buffers x_EBCD (shards
                   along the batch without communication).
  capacity_gather  the same buffers, filled and read by row gathers (one device: no
                   einsum multiply-adds over E * C slots).
  dropless         pairs sorted by expert + `jax.lax.ragged_dot`; nothing is dropped.
  auto             one of the three above, by `resolve_dispatch`: dropless for factor 0
                   on one device, capacity_gather on one device, else capacity_einsum
                   (its old name "capacity" is accepted: config.MOE_DISPATCH_ALIASES).
  expert_parallel  the capacity einsums with experts sharded over the mesh's
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

This is the one model/ file that imports parallel/ (parallel/expert.py): DESIGN.md
lets model/ import parallel/ only for expert-parallel dispatch and sharding-constraint
helpers.
"""

from __future__ import annotations

import math
from typing import Callable

import chex
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from model import backend as target
from model.moe import grouped
from model.moe.grouped import ExpertWeights, activate
from model.moe.router import Routing
from parallel import expert as ep_lib


# (x_BLD, routing, weights, ffn kind, capacity factor) -> (y_BLD, fraction of pairs dropped)
Dispatch = Callable[[jax.Array, Routing, ExpertWeights, str, float],
                    tuple[jax.Array, jax.Array]]


def capacity(length: int, num_selected: int, num_experts: int, factor: float) -> int:
  """C = min(L, ceil(R * L * factor / E)) per sequence; factor 0: C = L (no drops)."""
  if factor <= 0:
    return length
  # round(): 2 * 10 * 1.2 / 4 is 6.000000000000001 in floating point, not 7 slots.
  return min(length, max(1, math.ceil(round(num_selected * length * factor / num_experts, 9))))


def expert_dot(x_EMK: jax.Array, w_EKN: jax.Array, out_dtype=jnp.float32) -> jax.Array:
  """einsum("EMK,EKN->EMN") as a `lax.dot_general`: the expert matmuls are the MoE layer's
  only dot_generals (its dispatch / combine are einsums), which is how
  model/quantization.py's rule quantizes them and not the one-hot einsums."""
  return jax.lax.dot_general(x_EMK, w_EKN, (((2,), (1,)), ((0,), (0,))),
                             preferred_element_type=out_dtype)


def expert_ffn(x_EBCD: jax.Array, w: ExpertWeights, ffn: str) -> jax.Array:
  """Every expert e applied to its buffers x_EBCD[e]; float32 accumulation (the hidden
  activations rounded to the compute dtype before the nonlinearity, as in grouped.py).

  Expert-major buffers: that is the layout expert parallelism shards, and XLA:CPU
  cannot run the bf16 x bf16 -> f32 batched dot it picks for a B-major "BECD,EDF".
  """
  chex.assert_rank(x_EBCD, 4)
  chex.assert_shape(w.wi_EDF, (x_EBCD.shape[0], x_EBCD.shape[3], None))
  # B and C merged into one row dim: a weight gradient contracted over two dims makes
  # XLA:CPU transpose the cotangent first (see layers.einsum_rows).
  E, B, C, D = x_EBCD.shape
  x_EMD = x_EBCD.reshape(E, B * C, D)
  # The hidden buffers in the compute dtype (float32 accumulation, rounded on the way
  # out), as MaxText's: the widest per-layer tensors, E * B * C * F, at half the bytes
  # under bfloat16 (Mixtral 8x7B at 12 x 4096 per chip: 43.99 -> 36.55 GiB temporaries).
  h_EMF = expert_dot(x_EMD, w.wi_EDF, x_EMD.dtype)
  g_EMF = None if w.wg_EDF is None else expert_dot(x_EMD, w.wg_EDF, x_EMD.dtype)
  h_EMF = activate(h_EMF, g_EMF, ffn).astype(x_EBCD.dtype)
  y_EMD = checkpoint_name(expert_dot(h_EMF, w.wo_EFD), "mlpwo")  # remat.py
  return y_EMD.astype(x_EBCD.dtype).reshape(E, B, C, D)


def _queue_slots(indices_BLR: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
  """(expert_BRLE one-hot, slot_BRL): each pair's place in its expert's queue, rank-major
  (all first choices of the sequence, then all second choices, ...); a slot >= the
  capacity is a dropped pair."""
  chex.assert_rank(indices_BLR, 3)
  B, L, R = indices_BLR.shape
  expert_BRLE = jax.nn.one_hot(indices_BLR.transpose(0, 2, 1), num_experts, dtype=jnp.int32)
  queue = expert_BRLE.reshape(B, R * L, num_experts)
  slot_BRLE = (jnp.cumsum(queue, axis=1) - 1).reshape(B, R, L, num_experts)
  return expert_BRLE, (slot_BRLE * expert_BRLE).sum(-1)


def capacity_masks(indices_BLR: jax.Array, gates_BLR: jax.Array, num_experts: int,
                   cap: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """dispatch_BLEC (0/1), combine_BLEC (gates) and kept_B (pairs kept per sequence)."""
  chex.assert_equal_shape([indices_BLR, gates_BLR])
  expert_BRLE, slot_BRL = _queue_slots(indices_BLR, num_experts)
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


def _capacity_gathered(x_BLD: jax.Array, indices_BLR: jax.Array, gates_BLR: jax.Array,
                       w: ExpertWeights, ffn: str, num_experts: int, cap: int):
  """`_capacity_compute` with the buffers filled and read by row gathers instead of the
  one-hot einsums: the same buffers and numbers (up to summation order), without the
  2 * B * L * D * E * C multiply-adds of each einsum (at benchmark config MoE-S as many
  as an expert matmul). One device only: the einsums are what shard without
  communication (GShard), these gathers index across the batch's rows.
  """
  B, L, D = x_BLD.shape
  R, E = indices_BLR.shape[-1], num_experts
  _, slot_BRL = _queue_slots(indices_BLR, E)
  slot_BLR = slot_BRL.transpose(0, 2, 1)
  kept_BLR = slot_BLR < cap
  # Each kept pair's row in its sequence's [E * C] buffers; E * C (past the end) if dropped.
  row_BLR = jnp.where(kept_BLR, indices_BLR * cap + slot_BLR, E * cap)
  token_p = jnp.repeat(jnp.arange(L, dtype=jnp.int32), R)  # Pair p = (l, r) is token p // R.
  fill = lambda row_LR: jnp.full((E * cap,), L, jnp.int32).at[row_LR.reshape(-1)].set(
      token_p, mode="drop")
  source_BS = jax.vmap(fill)(row_BLR)  # Token of each buffer row; L: an empty row.
  zero_row = lambda a: jnp.concatenate([a, jnp.zeros_like(a[:, :1])], axis=1)
  x_BSD = jnp.take_along_axis(zero_row(x_BLD), source_BS[..., None], axis=1)
  x_EBCD = x_BSD.reshape(B, E, cap, D).transpose(1, 0, 2, 3)
  y_BSD = expert_ffn(x_EBCD, w, ffn).transpose(1, 0, 2, 3).reshape(B, E * cap, D)
  y_BLRD = jnp.take_along_axis(zero_row(y_BSD), row_BLR.reshape(B, L * R, 1), axis=1)
  y_BLD = jnp.einsum("BLRD,BLR->BLD", y_BLRD.reshape(B, L, R, D), gates_BLR.astype(x_BLD.dtype),
                     preferred_element_type=jnp.float32)
  return y_BLD.astype(x_BLD.dtype), kept_BLR.sum((1, 2))


def _dropped_frac(kept_B: jax.Array, pairs: int) -> jax.Array:
  # Integer count first: 1 - kept / pairs can come out as -3e-8 when nothing is dropped.
  return (pairs - kept_B.sum()).astype(jnp.float32) / pairs


def _shapes(x_BLD: jax.Array, routing: Routing, w: ExpertWeights) -> tuple[int, ...]:
  B, L, D = x_BLD.shape
  E, R = w.wi_EDF.shape[0], routing.indices_BLR.shape[-1]
  chex.assert_shape([routing.indices_BLR, routing.gates_BLR], (B, L, R))
  chex.assert_shape(w.wo_EFD, (E, None, D))
  return B, L, D, E, R


def _one_device() -> bool:
  """No mesh in context, or one of a single device: the batch-wide sort of "dropless"
  then costs no communication (under data parallelism GSPMD would gather it)."""
  mesh = jax.sharding.get_abstract_mesh()
  return mesh.empty or mesh.size == 1


def _capacity_buffers(compute, x_BLD, routing, w, ffn, capacity_factor):
  B, L, _, E, R = _shapes(x_BLD, routing, w)
  cap = capacity(L, R, E, capacity_factor)
  y_BLD, kept_B = compute(x_BLD, routing.indices_BLR, routing.gates_BLR, w, ffn, E, cap)
  return y_BLD, _dropped_frac(kept_B, B * L * R)


def capacity_einsum_dispatch(x_BLD: jax.Array, routing: Routing, w: ExpertWeights, ffn: str,
                             capacity_factor: float) -> tuple[jax.Array, jax.Array]:
  return _capacity_buffers(_capacity_compute, x_BLD, routing, w, ffn, capacity_factor)


def capacity_gather_dispatch(x_BLD: jax.Array, routing: Routing, w: ExpertWeights, ffn: str,
                             capacity_factor: float) -> tuple[jax.Array, jax.Array]:
  return _capacity_buffers(_capacity_gathered, x_BLD, routing, w, ffn, capacity_factor)


def resolve_dispatch(name: str, capacity_factor: float, one_device: bool) -> str:
  """The strategy `name` runs at `capacity_factor` on one device or a larger mesh. "auto":
  factor 0 on one device -> "dropless" (it never drops either: the same numbers, the routed
  work done once instead of over E * L slots); one device -> "capacity_gather"; a mesh ->
  "capacity_einsum" (the einsums shard along the batch, the gathers would not)."""
  if name != "auto":
    return name
  if one_device:
    return "dropless" if capacity_factor <= 0 else "capacity_gather"
  return "capacity_einsum"


# What an expert-parallel strategy computes without an expert axis (or at init).
LOCAL_EQUIVALENT = {"expert_parallel": "auto", "expert_parallel_ragged": "dropless"}


def strategies_run(cfg, one_device: bool, expert_axis: int) -> dict[str, str]:
  """The strategy `cfg.moe_dispatch` runs in training and in evaluation (their capacity
  factors may differ) on one device or a larger mesh with that expert axis size: what
  config.json's `_run.moe_dispatch` records."""
  def ran(factor: float) -> str:
    name = cfg.moe_dispatch
    if name in LOCAL_EQUIVALENT and expert_axis == 1:
      name = LOCAL_EQUIVALENT[name]
    return resolve_dispatch(name, factor, one_device)
  eval_factor = (cfg.capacity_factor if cfg.eval_capacity_factor is None
                 else cfg.eval_capacity_factor)
  return {"train": ran(cfg.capacity_factor), "eval": ran(eval_factor)}


def auto_dispatch(x_BLD: jax.Array, routing: Routing, w: ExpertWeights, ffn: str,
                  capacity_factor: float) -> tuple[jax.Array, jax.Array]:
  name = resolve_dispatch("auto", capacity_factor, _one_device())
  return DISPATCH[name](x_BLD, routing, w, ffn, capacity_factor)


def _sort_pairs(x_BLD: jax.Array, indices_BLR: jax.Array, num_experts: int):
  """(x_sorted [B*L*R, D] grouped by expert, the sort order, group_sizes_E)."""
  chex.assert_rank([x_BLD, indices_BLR], 3)
  B, L, D = x_BLD.shape
  chex.assert_shape(indices_BLR, (B, L, None))
  R = indices_BLR.shape[-1]
  expert_of_pair = indices_BLR.reshape(B * L * R)  # pair p is token p // R.
  order = jnp.argsort(expert_of_pair, stable=True)
  x_sorted = x_BLD.reshape(B * L, D)[order // R]
  return x_sorted, order, jnp.bincount(expert_of_pair, length=num_experts).astype(jnp.int32)


def _unsort_combine(y_sorted: jax.Array, order: jax.Array, gates_BLR: jax.Array,
                    dtype) -> jax.Array:
  chex.assert_rank(gates_BLR, 3)
  B, L, R = gates_BLR.shape
  chex.assert_shape([y_sorted], (B * L * R, None))
  chex.assert_shape(order, (B * L * R,))
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
  y_sorted = grouped.expert_ffn_rows(x_sorted, group_sizes_E, w, ffn, target.backend())
  y_BLD = _unsort_combine(y_sorted, order, routing.gates_BLR, x_BLD.dtype)
  return y_BLD, jnp.zeros((), jnp.float32)


def _check_expert_parallel(B: int, E: int, ep: int, name: str) -> None:
  if E % ep:
    raise ValueError(f"ModelConfig.num_experts={E}: must be divisible by the mesh's "
                     f"expert axis size {ep} for moe_dispatch='{name}'")
  shards = ep_lib.batch_shards()
  if B % shards:
    mesh = jax.sharding.get_abstract_mesh()
    axes = {a: int(mesh.shape[a]) for a in ep_lib.batch_axes()}
    raise ValueError(f"batch size {B} must be divisible by the mesh's batch axes {axes} "
                     f"(= {shards} row shards) for moe_dispatch='{name}'")


def _wire(w: ExpertWeights) -> ExpertWeights:
  """The expert weights as they enter the shard_map (cast back by `_unwire` inside).

  Their gradient leaves it summed over the batch axes they are replicated on (data,
  fsdp): an all-reduce that JAX 0.10 lowers, for a shard_map with some mesh axes left
  Auto (tensor, context), with a Shardy sharding custom-call as the root of its reduction
  computation. XLA:CPU's AllReducePromotion, which widens a bfloat16 all-reduce to float32,
  clones that computation as a binary op and aborts the process (`F hlo_instruction.cc]
  Invalid binary instruction opcode copy`; jaxlib 0.10.2, the newest on the registry;
  minimal reproducer in tests/parallel/test_expert.py). So on CPU a bfloat16 / float16
  weight enters in float32 and its gradient is summed in float32, which the numbers
  prefer anyway; TPU and GPU compile the half-width program and gather half the bytes.
  """
  if target.backend() != "cpu":
    return w
  widen = lambda a: a if a is None or jnp.dtype(a.dtype).itemsize >= 4 else a.astype(jnp.float32)
  return ExpertWeights(*(widen(a) for a in w))


def _unwire(w: ExpertWeights, dtype) -> ExpertWeights:
  return ExpertWeights(*(None if a is None else a.astype(dtype) for a in w))


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
    return DISPATCH[LOCAL_EQUIVALENT["expert_parallel"]](x_BLD, routing, w, ffn, capacity_factor)
  _check_expert_parallel(B, E, ep, "expert_parallel")

  dtype = w.wi_EDF.dtype

  def local(x_BLD, indices_BLR, gates_BLR, w):
    return _capacity_compute(x_BLD, indices_BLR, gates_BLR, _unwire(w, dtype), ffn, E, cap,
                             ep_lib.to_experts, ep_lib.from_experts)

  y_BLD, kept_B = ep_lib.shard_over_experts(
      local, (x_BLD, routing.indices_BLR, routing.gates_BLR), (_wire(w),))
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
    return DISPATCH[LOCAL_EQUIVALENT["expert_parallel_ragged"]](x_BLD, routing, w, ffn,
                                                               capacity_factor)
  _check_expert_parallel(B, E, ep, "expert_parallel_ragged")
  collective = collective or ep_lib.ragged_collective(target.backend())
  E_local = E // ep
  dtype = w.wi_EDF.dtype

  def local(x_BLD, indices_BLR, gates_BLR, w):
    w = _unwire(w, dtype)
    # This device's own rows (every batch axis is manual): its pairs, and the receive
    # buffer for the worst case, all ep devices' tokens routed to this device's experts
    # (a token picks an expert at most once: at most min(R, E_local) of its R pairs).
    # MaxText's dropless bound (ragged_buffer_factor -1); linear in the local tokens.
    pairs = x_BLD.shape[0] * L * R
    rows = ep * x_BLD.shape[0] * L * min(R, E_local)
    x_sorted, order, group_sizes_E = _sort_pairs(x_BLD, indices_BLR, E)
    x_recv, route = ep_lib.ragged_to_experts(x_sorted, group_sizes_E, rows,
                                             collective=collective)
    # Received rows come grouped by source device, then local expert: regroup them by
    # local expert for the ragged matmul (the padding rows form a last, unused group).
    counts = route.local_sizes_OX.reshape(-1)
    expert_of_row = jnp.repeat(
        jnp.append(jnp.tile(jnp.arange(E_local), ep), E_local),
        jnp.append(counts, rows - counts.sum()), total_repeat_length=rows)
    local_order = jnp.argsort(expert_of_row, stable=True)
    # Out in the compute dtype (float32 accumulation): half the bytes on the wire and in
    # HBM under bfloat16.
    y_local = grouped.expert_ffn_rows(x_recv[local_order], route.local_sizes_OX.sum(0), w,
                                      ffn, target.backend(), out_dtype=x_BLD.dtype)
    y_recv = jnp.zeros_like(y_local).at[local_order].set(y_local)
    y_sorted = ep_lib.ragged_from_experts(y_recv, route, pairs, collective=collective)
    return _unsort_combine(y_sorted, order, gates_BLR, x_BLD.dtype)

  y_BLD = ep_lib.shard_over_experts(local, (x_BLD, routing.indices_BLR, routing.gates_BLR),
                                    (_wire(w),))
  return y_BLD, jnp.zeros((), jnp.float32)


DISPATCH: dict[str, Dispatch] = {
    "auto": auto_dispatch,
    "capacity_einsum": capacity_einsum_dispatch,
    "capacity_gather": capacity_gather_dispatch,
    "dropless": dropless_dispatch,
    "expert_parallel": expert_parallel_dispatch,
    "expert_parallel_ragged": expert_parallel_ragged_dispatch,
}

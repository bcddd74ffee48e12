"""Grouped matmuls: rows sorted by expert -> each expert's FFN. One per backend, chosen
by `impl` from the backend the program is traced for (model/backend.py):

  blocked     CPU. `jax.lax.ragged_dot` on XLA:CPU lowers to one full-size dot per group
              with the other groups' rows masked, i.e. E times the work
              (docs/PERFORMANCE.md, "First round"); `grouped_ffn` below instead.
  megablox    TPU. The Pallas grouped matmul (`jax.experimental.pallas.ops.tpu.megablox`,
              MaxText's dropless kernel): it visits only the row tiles of each group, its
              temporaries are its output, linear in the rows (docs/moe.md). Its column
              tiles need d_model and the expert FFN width in multiples of 128; other
              widths (the smoke configs) run ragged_dot.
  ragged_dot  elsewhere (GPU): XLA's grouped kernel.

The blocked grouped matmul: each expert's rows are padded up to a multiple of
a block of `b` rows, so every block belongs to exactly one expert, and the FFN is one
batched dot over the blocks with each block's expert weight gathered:

  x_gbD = rows laid out by block;  h_gbF = einsum("gbD,gDF->gbF", x_gbD, W_EDF[expert_g])

The static number of blocks covers the worst case (every group padded by b - 1), so
the work is at most (p + E * (b - 1)) / p of the exact count for p rows, and every row's result
is its own expert's FFN of it: the numbers of ragged_dot (up to summation order).
Padding rows are zero and their outputs are dropped; blocks past the last group
compute zeros with some expert's weight (their gradient contributions are zero).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import chex
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.pallas.ops.tpu import megablox

from model import layers, quantization

# Rows per block. Smaller blocks waste less padding, larger ones run the dots closer
# to the matmul peak; the padding bound E * (b - 1) keeps it under ~1/8 of the rows.
MAX_BLOCK, MIN_BLOCK = 256, 8


def block_rows(num_rows: int, num_groups: int) -> int:
  """The largest power of two b in [MIN_BLOCK, MAX_BLOCK] with groups * b <= rows / 8."""
  b = MAX_BLOCK
  while b > MIN_BLOCK and num_groups * b * 8 > num_rows:
    b //= 2
  return b


def _bucket(ends_E: jax.Array, i_N: jax.Array) -> jax.Array:
  """searchsorted(ends_E, i_N, side="right") as a count (a rows x E compare is cheap for
  the few experts of a layer, and unlike jnp.searchsorted it runs inside shard_map)."""
  return jnp.sum(ends_E[None, :] <= i_N[:, None], axis=1, dtype=jnp.int32)


def grouped_ffn(x_pD: jax.Array, group_sizes_E: jax.Array,
                ffn: Callable[[jax.Array, jax.Array], jax.Array]) -> jax.Array:
  """Rows grouped by expert (group e is the next group_sizes_E[e] rows) -> ffn per row.

  Local letters (lowercase, this file only): p sorted rows, g blocks of b rows.

  `ffn(x_gbD, expert_g)` computes blocks of rows, all rows of block g with expert
  expert_g[g]'s weights. Rows past sum(group_sizes_E) come out as 0.
  """
  p, D = x_pD.shape
  E = group_sizes_E.shape[0]
  b = block_rows(p, E)
  g = -(-(p + E * (b - 1)) // b)  # Worst case: every group ends one row into a block.
  sizes_E = group_sizes_E.astype(jnp.int32)
  blocks_E = (sizes_E + b - 1) // b
  start_E = jnp.cumsum(sizes_E) - sizes_E  # First sorted row of each group.
  pad_start_E = (jnp.cumsum(blocks_E) - blocks_E) * b  # Its first padded row.
  expert_p = _bucket(jnp.cumsum(sizes_E), jnp.arange(p))
  valid_p = expert_p < E
  expert_p = jnp.minimum(expert_p, E - 1)
  dest_p = jnp.where(valid_p, pad_start_E[expert_p] + jnp.arange(p) - start_E[expert_p],
                     g * b)  # Out of range: dropped by the scatter below.
  x_gbD = jnp.zeros((g * b, D), x_pD.dtype).at[dest_p].set(x_pD, mode="drop")
  # Block g belongs to the group whose padded range holds it (last group past the end).
  expert_g = jnp.minimum(_bucket(jnp.cumsum(blocks_E), jnp.arange(g)), E - 1)
  y_gbD = ffn(x_gbD.reshape(g, b, D), expert_g)
  y_pD = y_gbD.reshape(g * b, -1)[jnp.minimum(dest_p, g * b - 1)]
  return jnp.where(valid_p[:, None], y_pD, 0)


class ExpertWeights(NamedTuple):
  wi_EDF: jax.Array
  wg_EDF: jax.Array | None  # Gated FFNs (swiglu, geglu) only.
  wo_EFD: jax.Array


def activate(h: jax.Array, gate: jax.Array | None, ffn: str) -> jax.Array:
  """layers.activate (FeedForward's nonlinearity), in float32."""
  return layers.activate(h.astype(jnp.float32),
                         None if gate is None else gate.astype(jnp.float32), ffn)


def impl(backend: str) -> str:
  """The grouped matmul that runs on `backend` (see the module docstring)."""
  return {"cpu": "blocked", "tpu": "megablox"}.get(backend, "ragged_dot")


P = jax.sharding.PartitionSpec
# megablox.gmm's tiles: rows, then one size for the contraction and output columns (the
# backward pass reuses the tiling with the two swapped). 512 x 1024 (MaxText's) overflows
# the 16 MiB of scoped VMEM in the weight-gradient kernel (tgmm) of the moe preset.
GMM_ROWS, GMM_COLS, LANES = 512, 512, 128


def megablox_fits(d_in: int, d_out: int) -> bool:
  """Whether megablox takes a [.., d_in] x [G, d_in, d_out] product: its column tiles are
  multiples of the TPU's 128 lanes (ragged_dot runs it otherwise)."""
  return d_in % LANES == 0 and d_out % LANES == 0


def _megablox_dot(x_pK: jax.Array, w_GKN: jax.Array, group_sizes: jax.Array,
                  out_dtype) -> jax.Array:
  """megablox.gmm with the rows padded to a multiple of its row tile. Rows past
  sum(group_sizes) are left unwritten by the kernel: callers never read them."""
  p, k = x_pK.shape
  tm = min(GMM_ROWS, -(-p // LANES) * LANES)
  pad = -p % tm
  x_pK = jnp.pad(x_pK, ((0, pad), (0, 0))) if pad else x_pK
  t = min(GMM_COLS, k, w_GKN.shape[2])
  gmm = lambda x, w, sizes: megablox.gmm(x, w, sizes, out_dtype, (tm, t, t))
  # GSPMD cannot partition a Mosaic kernel: the mesh axes still automatic here (all but
  # those of expert parallelism's shard_map, parallel/expert.py) see it whole.
  auto = jax.sharding.get_abstract_mesh().auto_axes
  if auto:
    gmm = jax.shard_map(gmm, in_specs=P(), out_specs=P(), axis_names=set(auto),
                        check_vma=False)
  y = gmm(x_pK, w_GKN, group_sizes)
  return y[:p] if pad else y


def _blocked_ffn(x_pD, group_sizes_E, w: ExpertWeights, ffn: str) -> jax.Array:
  dtype = x_pD.dtype

  # Rematerialised: the backward pass gathers the block weights again rather than
  # keeping [G, D, F] copies of them alive from the forward pass (per layer).
  @jax.checkpoint
  def dot(a, w_EXY, expert_g):
    # A lax.dot_general, as dispatch.expert_dot: what model/quantization.py quantizes.
    return jax.lax.dot_general(a, w_EXY[expert_g].astype(dtype), (((2,), (1,)), ((0,), (0,))),
                               preferred_element_type=jnp.float32)

  def blocks(x_gbD, expert_g):
    dot_g = lambda a, w_EXY: dot(a, w_EXY, expert_g)
    g_gbF = None if w.wg_EDF is None else dot_g(x_gbD, w.wg_EDF)
    h_gbF = activate(dot_g(x_gbD, w.wi_EDF), g_gbF, ffn).astype(dtype)
    return checkpoint_name(dot_g(h_gbF, w.wo_EFD), "mlpwo")
  return grouped_ffn(x_pD, group_sizes_E, blocks)


def expert_ffn_rows(x_pD: jax.Array, group_sizes_E: jax.Array, w: ExpertWeights, ffn: str,
                    backend: str, out_dtype=jnp.float32) -> jax.Array:
  """Rows grouped by expert -> their expert's FFN, in `out_dtype` (float32 accumulation
  and activation in every implementation). Rows past sum(group_sizes_E) are 0 on CPU and
  GPU and unspecified on TPU (megablox does not write them): callers drop them."""
  chex.assert_rank(x_pD, 2)
  chex.assert_shape(group_sizes_E, (w.wi_EDF.shape[0],))
  chex.assert_shape(w.wo_EFD, (w.wi_EDF.shape[0], w.wi_EDF.shape[2], x_pD.shape[1]))
  dtype, kind = x_pD.dtype, impl(backend)
  if kind == "blocked":
    return _blocked_ffn(x_pD, group_sizes_E, w, ffn).astype(out_dtype)
  if kind == "megablox" and (not megablox_fits(*w.wi_EDF.shape[1:])
                             or quantization.quantizes_here("ragged_dot")):
    kind = "ragged_dot"  # Qwix quantizes a ragged_dot; into the Pallas kernel it cannot see.
  if kind == "megablox":
    dot = lambda a, b, out: _megablox_dot(a, b.astype(dtype), group_sizes_E, out)
  else:
    dot = lambda a, b, out: jax.lax.ragged_dot(a, b.astype(dtype), group_sizes_E,
                                               preferred_element_type=out)
  # The hidden rows in the compute dtype (float32 accumulation, rounded on the way out),
  # as expert_ffn's: half the bytes of the widest per-layer buffers under bfloat16.
  h_pF = dot(x_pD, w.wi_EDF, dtype)
  g_pF = None if w.wg_EDF is None else dot(x_pD, w.wg_EDF, dtype)
  return checkpoint_name(dot(activate(h_pF, g_pF, ffn).astype(dtype), w.wo_EFD, out_dtype),
                         "mlpwo")

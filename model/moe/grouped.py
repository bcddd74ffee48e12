"""Blocked grouped matmul: rows sorted by expert -> each expert's FFN, as dense batched dots.

`jax.lax.ragged_dot` on XLA:CPU lowers to one full-size dot per group with the other
groups' rows masked, i.e. E times the work (docs/PERFORMANCE.md, "First round").
Here each expert's rows are padded up to a multiple of
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

from typing import Callable

import jax
import jax.numpy as jnp

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

"""Blocked grouped matmul: rows sorted by expert -> each expert's FFN, as dense batched dots.

`jax.lax.ragged_dot` on XLA:CPU lowers to one full-size dot per group with the other
groups' rows masked, i.e. E times the work (docs/PERFORMANCE.md, "First round").
Here each expert's rows are padded up to a multiple of
a block of `b` rows, so every block belongs to exactly one expert, and the FFN is one
batched dot over the blocks with each block's expert weight gathered:

  x_GbD = rows laid out by block;  h_GbF = einsum("GbD,GDF->GbF", x_GbD, W_EDF[expert_G])

The static number of blocks covers the worst case (every group padded by b - 1), so
the work is at most (P + E * (b - 1)) / P of the exact count, and every row's result
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
  """The largest power of two b in [MIN_BLOCK, MAX_BLOCK] with G * b <= rows / 8."""
  b = MAX_BLOCK
  while b > MIN_BLOCK and num_groups * b * 8 > num_rows:
    b //= 2
  return b


def _bucket(ends_E: jax.Array, i_N: jax.Array) -> jax.Array:
  """searchsorted(ends_E, i_N, side="right") as a count (a P x E compare is cheap for
  the few experts of a layer, and unlike jnp.searchsorted it runs inside shard_map)."""
  return jnp.sum(ends_E[None, :] <= i_N[:, None], axis=1, dtype=jnp.int32)


def grouped_ffn(x_PD: jax.Array, group_sizes_E: jax.Array,
                ffn: Callable[[jax.Array, jax.Array], jax.Array]) -> jax.Array:
  """Rows grouped by expert (group e is the next group_sizes_E[e] rows) -> ffn per row.

  `ffn(x_GbD, expert_G)` computes blocks of rows, all rows of block g with expert
  expert_G[g]'s weights. Rows past sum(group_sizes_E) come out as 0.
  """
  P, D = x_PD.shape
  E = group_sizes_E.shape[0]
  b = block_rows(P, E)
  G = -(-(P + E * (b - 1)) // b)  # Worst case: every group ends one row into a block.
  sizes_E = group_sizes_E.astype(jnp.int32)
  blocks_E = (sizes_E + b - 1) // b
  start_E = jnp.cumsum(sizes_E) - sizes_E  # First sorted row of each group.
  pad_start_E = (jnp.cumsum(blocks_E) - blocks_E) * b  # Its first padded row.
  expert_P = _bucket(jnp.cumsum(sizes_E), jnp.arange(P))
  valid_P = expert_P < E
  expert_P = jnp.minimum(expert_P, E - 1)
  dest_P = jnp.where(valid_P, pad_start_E[expert_P] + jnp.arange(P) - start_E[expert_P],
                     G * b)  # Out of range: dropped by the scatter below.
  x_GbD = jnp.zeros((G * b, D), x_PD.dtype).at[dest_P].set(x_PD, mode="drop")
  # Block g belongs to the group whose padded range holds it (last group past the end).
  expert_G = jnp.minimum(_bucket(jnp.cumsum(blocks_E), jnp.arange(G)), E - 1)
  y_GbD = ffn(x_GbD.reshape(G, b, D), expert_G)
  y_PD = y_GbD.reshape(G * b, -1)[jnp.minimum(dest_P, G * b - 1)]
  return jnp.where(valid_P[:, None], y_PD, 0)

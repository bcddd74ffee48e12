"""Context parallelism: the sequence split over the mesh's "context" axis, K/V passed by ring.

Generic over the attention math (this file never imports model/): model/attention/ring.py
hands in its per-shard function. Only the "context" axis is manual inside `jax.shard_map`;
data / fsdp / tensor / expert stay Auto, so GSPMD still splits the batch and the heads of
the same arrays.

Layout. Causal attention over contiguous slices of the sequence is unbalanced (the last
of c devices sees every key, the first only its own), so under a context axis the whole
network runs in the "zig-zag" token order of Megatron-LM's and torchtitan's context
parallelism: the sequence is cut into 2c chunks of C = L / 2c tokens and device i holds
chunks i and 2c - 1 - i, so every device attends to the same number of key chunks. The
order is set once per forward pass: `model/transformer.py` moves its [B, L] inputs
(tokens, positions, segment ids) into it with `to_zigzag_layout` and its output back with
`from_zigzag_layout` (two `ppermute`s each: every device sends each half of its slice to
one other device). Every layer between (attention by ring, the FFN / MoE, the norms) runs
on the permuted tokens, so no layer moves or copies its activations; only the ring's
K/V blocks travel (c `ppermute`s per attention call).

The mesh comes from context (`jax.set_mesh`, parallel.mesh_context), as for expert
parallelism (parallel/expert.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

AXIS = "context"
P = jax.sharding.PartitionSpec


def context_axis_size(axis: str = AXIS) -> int:
  """Size of `axis` in the context mesh; 1 with no mesh or a mesh without the axis."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or axis not in mesh.axis_names:
    return 1
  return int(mesh.shape[axis])


def shard_over_context(fn: Callable[..., Any], *args: Any, axis: str = AXIS,
                       check_vma: bool = True) -> Any:
  """fn(*shards) with `axis` manual: every leaf of `args` and of the result is split
  along dimension 1 (the length of [B, L, ...] arrays), every other dimension Auto."""
  return jax.shard_map(fn, in_specs=P(None, axis), out_specs=P(None, axis),
                       axis_names={axis}, check_vma=check_vma)(*args)


def ring_pass(tree: Any, axis: str = AXIS) -> Any:
  """Every device's `tree` to the next device of the ring (i -> i + 1 mod c)."""
  c = jax.lax.axis_size(axis)
  perm = [(i, (i + 1) % c) for i in range(c)]
  return jax.tree.map(lambda x: jax.lax.ppermute(x, axis, perm), tree)


def varying(tree: Any, axis: str | None = AXIS) -> Any:
  """`tree` typed as varying over `axis` and every other manual axis of the context mesh
  (a fresh accumulator, e.g. zeros, is typed as replicated; loop carries and `lax.cond`
  branches must agree with the per-device data, which inside a pipeline stage varies over
  "stage" too). axis=None: the mesh's manual axes only (outside `shard_over_context`)."""
  manual = set(jax.sharding.get_abstract_mesh().manual_axes) | ({axis} if axis else set())

  def cast(x):
    missing = tuple(sorted(manual - jax.typeof(x).manual_axis_type.varying))
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(cast, tree)


def ring_source(step: jax.Array, axis: str = AXIS) -> jax.Array:
  """Which device's blocks this device holds after `step` ring passes."""
  c = jax.lax.axis_size(axis)
  return jnp.mod(jax.lax.axis_index(axis) - step, c)


def zigzag_chunks(device: jax.Array, c: int) -> tuple[jax.Array, jax.Array]:
  """The two chunks (of 2c along the sequence) that `device` holds in the zig-zag layout."""
  return device, 2 * c - 1 - device


def _half_destinations(c: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
  """ppermute pairs sending device i's first half (chunk 2i) and second half (chunk 2i+1)
  to the device that holds that chunk in the zig-zag layout."""
  dest = lambda h: h if h < c else 2 * c - 1 - h
  return [(i, dest(2 * i)) for i in range(c)], [(i, dest(2 * i + 1)) for i in range(c)]


def _halves(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  n = x.shape[1]
  if n % 2:
    raise ValueError(f"context parallelism splits each device's {n} tokens into two chunks: "
                     "the sequence length must be divisible by 2 * mesh.context")
  return x[:, :n // 2], x[:, n // 2:]


def _to_zigzag(tree: Any, axis: str = AXIS) -> Any:
  """Inside `shard_over_context`: contiguous slices (dim 1) -> zig-zag chunks (i, 2c-1-i)."""
  c = jax.lax.axis_size(axis)
  if c == 1:
    return tree
  first_pairs, second_pairs = _half_destinations(c)
  even = jax.lax.axis_index(axis) % 2 == 0

  def move(x):
    a, b = _halves(x)
    ra = jax.lax.ppermute(a, axis, first_pairs)
    rb = jax.lax.ppermute(b, axis, second_pairs)
    # Chunk d (mine first) is a first half when d is even; chunk 2c-1-d then is a second.
    return jnp.concatenate([jnp.where(even, ra, rb), jnp.where(even, rb, ra)], axis=1)

  return jax.tree.map(move, tree)


def _from_zigzag(tree: Any, axis: str = AXIS) -> Any:
  """The inverse of `_to_zigzag`."""
  c = jax.lax.axis_size(axis)
  if c == 1:
    return tree
  first_pairs, second_pairs = _half_destinations(c)
  inverse = lambda pairs: [(dst, src) for src, dst in pairs]
  even = jax.lax.axis_index(axis) % 2 == 0

  def move(x):
    first, second = _halves(x)
    ra = jax.lax.ppermute(jnp.where(even, first, second), axis, inverse(first_pairs))
    rb = jax.lax.ppermute(jnp.where(even, second, first), axis, inverse(second_pairs))
    return jnp.concatenate([ra, rb], axis=1)

  return jax.tree.map(move, tree)


def to_zigzag_layout(tree: Any, axis: str = AXIS) -> Any:
  """Global [B, L, ...] arrays (every leaf; L split over `axis`) from the natural token
  order into the zig-zag one: afterwards device i's slice holds chunks i and 2c - 1 - i
  of the 2c. The identity without the axis (or with one device on it)."""
  if (c := context_axis_size(axis)) == 1:
    return tree
  for n in {x.shape[1] for x in jax.tree.leaves(tree)}:
    if n % (2 * c):
      raise ValueError(f"context parallelism over {c} devices cuts the sequence into "
                       f"2 * {c} chunks: length {n} is not divisible by {2 * c}")
  return shard_over_context(lambda t: _to_zigzag(t, axis), tree, axis=axis)


def from_zigzag_layout(tree: Any, axis: str = AXIS) -> Any:
  """The inverse of `to_zigzag_layout`: back to the natural token order."""
  if context_axis_size(axis) == 1:
    return tree
  return shard_over_context(lambda t: _from_zigzag(t, axis), tree, axis=axis)

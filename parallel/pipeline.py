"""Pipeline parallelism over the mesh's "stage" axis: the GPipe schedule inside jit.

Generic over the stage's computation (this file never imports model/): the caller hands in
`stage_fn(params, x, extras, key)`, one stage's slice of a scanned layer stack applied to
one microbatch. The stacked parameters ([layers, ...], the "layers" logical axis, mapped
to "stage" by parallel/rules.py) arrive split along their first dimension, so stage s holds
layers [s n/S, (s+1) n/S): contiguous stages.

Schedule (GPipe, Huang et al. 2019). M microbatches and S stages take M + S - 1 ticks of
a `lax.scan`; at tick t stage s works on microbatch t - s (stage 0 reads it from the
input, every other stage from what its predecessor sent at tick t - 1), and all stages
then pass their output one stage on with one `ppermute` (s -> s + 1), a collective permute
over the stage axis. The last stage's output of microbatch m (tick m + S - 1) is the
pipeline's output; GSPMD sends it from the last stage to the others (which compute the
head on it, replicated), and in the backward pass sums the input's gradient over the
stages (only stage 0's is not zero): activations cross stages, weights never do. A stage idles (computes on
nothing, its result dropped) in S - 1 of the M + S - 1 ticks: the bubble
(S - 1) / (M + S - 1). The backward pass is the scan's transpose (JAX's autodiff): the
reverse schedule with the permutes reversed, every stage keeping its M microbatches'
activations (GPipe's memory; remat policies apply inside the stage as without a pipeline).

Only "stage" is manual inside `jax.shard_map`; data / fsdp / context / tensor / expert stay
Auto, so GSPMD still splits the microbatches' rows and the layers' weights within a stage.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from parallel.context import context_axis_size

AXIS = "stage"
P = jax.sharding.PartitionSpec


def stage_axis_size(axis: str = AXIS) -> int:
  """Size of the stage axis of the context mesh (1: no mesh, no axis, or one stage)."""
  return context_axis_size(axis)


def bubble_fraction(stages: int, microbatches: int) -> float:
  """GPipe's idle share of a step: (S - 1) / (M + S - 1)."""
  return (stages - 1) / (microbatches + stages - 1)


def to_microbatches(x: jax.Array, microbatches: int) -> jax.Array:
  """[B, ...] -> [M, B / M, ...], microbatch m holding rows m, m + M, m + 2M, ...: with the
  rows split over the data axes in contiguous blocks, each block keeps its share of every
  microbatch, so no row moves between devices."""
  B = x.shape[0]
  if B % microbatches:
    raise ValueError(f"the pipeline splits the batch of {B} rows into {microbatches} "
                     "microbatches: the rows must be divisible by train.pipeline_microbatches")
  return jnp.swapaxes(x.reshape(B // microbatches, microbatches, *x.shape[1:]), 0, 1)


def from_microbatches(x: jax.Array) -> jax.Array:
  """The inverse of `to_microbatches`: [M, B / M, ...] -> [B, ...]."""
  return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _schedule(stage_fn: Callable[..., jax.Array], params: Any, x_M: jax.Array, extras_M: Any,
              key: jax.Array | None, axis: str) -> jax.Array:
  """One device's part of the GPipe schedule (inside shard_map): [1, M, ...], the outputs
  this stage finished (the last stage's are the pipeline's; the others' stay zeros)."""
  S, M = jax.lax.axis_size(axis), x_M.shape[0]
  stage = jax.lax.axis_index(axis)
  forward = [(i, i + 1) for i in range(S - 1)]

  def tick(carry, t):
    received, out_M = carry
    m = jnp.clip(t - stage, 0, M - 1)  # The microbatch this stage works on (if any).
    x = jnp.where(stage == 0, x_M[jnp.clip(t, 0, M - 1)], received)
    extras = jax.tree.map(lambda e: e[m], extras_M)
    k = None if key is None else jax.random.fold_in(jax.random.fold_in(key, m), stage)
    y = stage_fn(params, x, extras, k)
    done = t - (S - 1)  # The microbatch the last stage finishes at this tick.
    slot = jnp.clip(done, 0, M - 1)
    write = (stage == S - 1) & (done >= 0)
    out_M = jax.lax.dynamic_update_index_in_dim(
        out_M, jnp.where(write, y, out_M[slot]), slot, 0)
    return (jax.lax.ppermute(y, axis, forward), out_M), None

  start = (jnp.zeros_like(x_M[0]), jnp.zeros_like(x_M))  # Varying over the stages, as x_M.
  (_, out_M), _ = jax.lax.scan(tick, start, jnp.arange(M + S - 1))
  return out_M[None]


def gpipe(stage_fn: Callable[..., jax.Array], stacked_params: Any, x_M: jax.Array,
          extras_M: Any = None, key: jax.Array | None = None, axis: str = AXIS) -> jax.Array:
  """The layer stack over M microbatches, pipelined over the mesh's `axis` (GPipe).

  stage_fn(params, x, extras, key) -> y (x's shape and dtype): one stage's layers
  (`params`: every leaf of `stacked_params` cut to this stage's n / S layers) on one
  microbatch `x` ([b, ...]); `extras`: that microbatch's slice of `extras_M` (e.g. its
  positions); `key`: `key` folded with the microbatch and the stage (None: none).
  x_M: [M, b, ...]; extras_M: a pytree of [M, ...] arrays. Returns the stack's output
  [M, b, ...]: the last stage's, which GSPMD sends where the next op needs it (a psum of
  the masked outputs inside would do the same, but aborts XLA:CPU in bfloat16)."""
  S = stage_axis_size(axis)
  for leaf in jax.tree.leaves(stacked_params):
    if leaf.shape[0] % S:
      raise ValueError(f"a stacked parameter of {leaf.shape[0]} layers cannot be cut into "
                       f"{S} stages: the layers must be divisible by mesh.stage")
  keys = () if key is None else (key,)

  def run(params, x_SM, extras, *k):
    return _schedule(stage_fn, params, x_SM[0], extras, k[0] if k else None, axis)

  # The input reaches every stage as its own copy (only stage 0 reads it), so its gradient
  # is summed over the stages by GSPMD outside: a replicated input's, summed inside by
  # shard_map, aborts XLA:CPU in bfloat16 (its all-reduce promotion pass).
  x_SM = jnp.broadcast_to(x_M[None], (S, *x_M.shape))
  specs = (jax.tree.map(lambda _: P(axis), stacked_params), P(axis), jax.tree.map(
      lambda _: P(), extras_M), *(P() for _ in keys))
  out_SM = jax.shard_map(run, in_specs=specs, out_specs=P(axis), axis_names={axis})(
      stacked_params, x_SM, extras_M, *keys)
  return out_SM[S - 1]

"""The circular (interleaved) pipeline schedule over the mesh's "stage" axis, inside jit.

MaxText's circular pipeline (`num_pipeline_repeats`, its layers/pipeline.py): the layer stack
is cut into S R chunks of n / (S R) layers, chunk c on stage c mod S, and each microbatch
goes round the ring of stages R times (a `ppermute` s -> (s + 1) mod S): repeat r on stage s
applies chunk r S + s. A stage holds R chunks and works on a chunk per tick, so the
schedule takes R M + S - 1 ticks of n / (S R) layers each: the bubble is
(S - 1) / (R M + S - 1), R times smaller than GPipe's (parallel/pipeline.py) at the same M.

Microbatch order: groups of S microbatches, each group going round R times. The item that
stage 0 starts at tick i is microbatch (i // (S R)) S + i mod S at repeat (i mod S R) // S;
stage s works on item t - s at tick t. The last stage's output of an item reaches stage 0
at the very tick that microbatch's next repeat starts there (S items later, the same
microbatch, the next repeat), so no stage buffers anything: M must be a multiple of S.

The weights' layout (the part that is not the schedule). Stage s must hold the chunks
s, s + S, ..., s + (R - 1) S, but the stacked parameters ([layers, ...], "layers" mapped to
"stage") split contiguously: stage s holds rows [s n/S, (s+1) n/S). So the stack's rows are
kept in *pipeline order* while a run trains with R > 1: row block p (of n / (S R) rows) holds
chunk (p mod R) S + p // R, i.e. the layer order [R, S, k] transposed to [S, R, k]
(`to_pipeline_order`). Stage s's contiguous rows are then its R chunks, repeat r's at local
block r, and no weight crosses the stage axis in a step: only activations do. The run
permutes its state into that order once (at init / restore) and back into layer order for
every checkpoint (`to_layer_order`): train/state.py PipelineOrder. `circular` reads the stack in
pipeline order; handing it a stack in layer order computes another (wrong) network.

What a chunk reports besides its output (an MoE layer's loads and losses: `stage_fn`'s
aux) is summed over the ticks where it works, as GPipe sums a stage's, into that chunk's
rows: the aux leaves the schedule in pipeline order, like the parameters.

Only "stage" is manual inside `jax.shard_map`, as in GPipe, whose `stage_map` this schedule
runs in: the same input gather to stage 0 and output scatter from the last stage.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from parallel.pipeline import AXIS, stage_axis_size, stage_map


def bubble_fraction(stages: int, microbatches: int, repeats: int) -> float:
  """The circular schedule's idle share of a step: (S - 1) / (R M + S - 1)."""
  return (stages - 1) / (repeats * microbatches + stages - 1)


def to_pipeline_order(x: jax.Array, stages: int, repeats: int) -> jax.Array:
  """Rows [n, ...] in layer order -> pipeline order: [R, S, k] -> [S, R, k] (k = n / (S R)),
  so the contiguous block of stage s holds chunks s, s + S, ..., in repeat order."""
  k = _chunk_rows(x.shape[0], stages, repeats)
  return jnp.swapaxes(x.reshape(repeats, stages, k, *x.shape[1:]), 0, 1).reshape(x.shape)


def to_layer_order(x: jax.Array, stages: int, repeats: int) -> jax.Array:
  """The inverse of `to_pipeline_order`: [S, R, k] -> [R, S, k]."""
  k = _chunk_rows(x.shape[0], stages, repeats)
  return jnp.swapaxes(x.reshape(stages, repeats, k, *x.shape[1:]), 0, 1).reshape(x.shape)


def _chunk_rows(n: int, stages: int, repeats: int) -> int:
  if n % (stages * repeats):
    raise ValueError(f"a stacked parameter of {n} rows cannot be cut into {stages} stages x "
                     f"{repeats} repeats: the rows must be divisible by mesh.stage x "
                     "train.pipeline_repeats")
  return n // (stages * repeats)


def _item(i: jax.Array, stages: int, repeats: int) -> tuple[jax.Array, jax.Array]:
  """(microbatch, repeat) of the item stage 0 starts at tick i."""
  group, within = i // (stages * repeats), i % (stages * repeats)
  return group * stages + within % stages, within // stages


def _schedule(stage_fn: Callable[..., tuple[jax.Array, Any]], params: Any, x_M: jax.Array,
              extras_M: Any, key: jax.Array | None, repeats: int,
              axis: str) -> tuple[jax.Array, Any]:
  """One device's part of the circular schedule (inside shard_map): [M, ...], the
  outputs this stage finished (the last stage's are the pipeline's; the others' zeros),
  and the sum of `stage_fn`'s aux over the M microbatches each of its R chunks worked on,
  the chunks' rows stacked in the stage's (pipeline-order) row order: [R k, ...]."""
  S, M, R = jax.lax.axis_size(axis), x_M.shape[0], repeats
  stage = jax.lax.axis_index(axis)
  ring = [(i, (i + 1) % S) for i in range(S)]
  chunks = jax.tree.map(lambda w: w.reshape(R, w.shape[0] // R, *w.shape[1:]), params)

  def tick(carry, t):
    received, out_M, aux_R = carry
    i = t - stage  # The item this stage works on (if 0 <= i < R M).
    m, r = _item(jnp.clip(i, 0, R * M - 1), S, R)
    x = jnp.where((stage == 0) & (r == 0), x_M[m], received)
    extras = jax.tree.map(lambda e: e[m], extras_M)
    k = None if key is None else jax.random.fold_in(jax.random.fold_in(key, m), r * S + stage)
    y, aux = stage_fn(jax.tree.map(lambda w: w[r], chunks), x, extras, k)
    works = (i >= 0) & (i < R * M)  # Not a bubble tick: its aux counts, for chunk r.
    aux_R = jax.tree.map(lambda acc, a: acc.at[r].add(jnp.where(works, a, jnp.zeros_like(a))),
                         aux_R, aux)
    write = (stage == S - 1) & (r == R - 1) & works
    out_M = jax.lax.dynamic_update_index_in_dim(out_M, jnp.where(write, y, out_M[m]), m, 0)
    return (jax.lax.ppermute(y, axis, ring), out_M, aux_R), None

  aux_shapes = jax.eval_shape(stage_fn, jax.tree.map(lambda w: w[0], chunks), x_M[0],
                              jax.tree.map(lambda e: e[0], extras_M), key)[1]
  aux_zeros = jax.tree.map(lambda s: jax.lax.pcast(jnp.zeros((R, *s.shape), s.dtype), (axis,),
                                                   to="varying"), aux_shapes)
  start = (jnp.zeros_like(x_M[0]), jnp.zeros_like(x_M), aux_zeros)  # Varying over stages.
  (_, out_M, aux_R), _ = jax.lax.scan(tick, start, jnp.arange(R * M + S - 1))
  return out_M, jax.tree.map(lambda a: a.reshape(R * a.shape[1], *a.shape[2:]), aux_R)


def circular(stage_fn: Callable[..., tuple[jax.Array, Any]], stacked_params: Any,
             x_M: jax.Array, extras_M: Any = None, key: jax.Array | None = None,
             repeats: int = 2, axis: str = AXIS) -> tuple[jax.Array, Any]:
  """The layer stack over M microbatches, pipelined round the ring of the mesh's `axis`
  `repeats` times (the circular schedule). As `pipeline.gpipe`, but `stacked_params` are in
  pipeline order (`to_pipeline_order`) and stage_fn gets one chunk's n / (S R) layers (its
  `key` folded with the microbatch and the chunk). M must be a multiple of S. Returns the
  output [M, b, ...] and the aux summed over each chunk's M microbatches, stacked over the
  stages ([S, R k, ...]: its rows, reshaped to [n, ...], are in pipeline order, as the
  parameters')."""
  S, M = stage_axis_size(axis), x_M.shape[0]
  if M % S:
    raise ValueError(f"the circular pipeline feeds groups of {S} microbatches (one per "
                     f"stage) round the ring: train.pipeline_microbatches ({M}) must be a "
                     f"multiple of mesh.stage ({S})")
  for leaf in jax.tree.leaves(stacked_params):
    _chunk_rows(leaf.shape[0], S, repeats)
  schedule = lambda p, x, e, k: _schedule(stage_fn, p, x, e, k, repeats, axis)
  return stage_map(schedule, stacked_params, x_M, extras_M, key, axis)

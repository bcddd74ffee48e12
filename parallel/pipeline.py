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
pipeline's output. Outside the schedule the rules table splits the rows over the stages
too (parallel/rules.py "batch"), so the head and loss after it run data-parallel over
them: `stage_map` gathers the input's rows onto stage 0 and scatters the output's from
the last stage to their stages, collective permutes both ways (their transposes in the
backward pass): activations cross stages, weights never do. A stage idles (computes on
nothing, its result dropped) in S - 1 of the M + S - 1 ticks: the bubble
(S - 1) / (M + S - 1). The backward pass is the scan's transpose (JAX's autodiff): the
reverse schedule with the permutes reversed, every stage keeping its M microbatches'
activations (GPipe's memory; remat policies apply inside the stage as without a pipeline).

What a stage reports besides its output (`stage_fn`'s aux: an MoE layer's expert loads and
balance losses) is summed in the scan's carry over the ticks where the stage works (not
its bubble ticks) and leaves the shard_map stacked over the stages; the caller turns the
sums over microbatches into what its unpipelined step would have computed.

Only "stage" is manual inside `jax.shard_map`; data / fsdp / context / tensor / expert stay
Auto, so GSPMD still splits the microbatches' rows and the layers' weights within a stage
(the rules in force there drop "stage": `rules.without_axis`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from parallel.context import context_axis_size
from parallel import rules

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


def _schedule(stage_fn: Callable[..., tuple[jax.Array, Any]], params: Any, x_M: jax.Array,
              extras_M: Any, key: jax.Array | None, axis: str) -> tuple[jax.Array, Any]:
  """One device's part of the GPipe schedule (inside shard_map): [M, ...], the outputs
  this stage finished (the last stage's are the pipeline's; the others' stay zeros), and
  the sum of `stage_fn`'s aux over the M microbatches this stage worked on."""
  S, M = jax.lax.axis_size(axis), x_M.shape[0]
  stage = jax.lax.axis_index(axis)
  forward = [(i, i + 1) for i in range(S - 1)]

  def tick(carry, t):
    received, out_M, aux_sum = carry
    m = jnp.clip(t - stage, 0, M - 1)  # The microbatch this stage works on (if any).
    x = jnp.where(stage == 0, x_M[jnp.clip(t, 0, M - 1)], received)
    extras = jax.tree.map(lambda e: e[m], extras_M)
    k = None if key is None else jax.random.fold_in(jax.random.fold_in(key, m), stage)
    y, aux = stage_fn(params, x, extras, k)
    works = (t - stage >= 0) & (t - stage < M)  # Not a bubble tick: its aux counts.
    aux_sum = jax.tree.map(lambda a, b: a + jnp.where(works, b, jnp.zeros_like(b)),
                           aux_sum, aux)
    done = t - (S - 1)  # The microbatch the last stage finishes at this tick.
    slot = jnp.clip(done, 0, M - 1)
    write = (stage == S - 1) & (done >= 0)
    out_M = jax.lax.dynamic_update_index_in_dim(
        out_M, jnp.where(write, y, out_M[slot]), slot, 0)
    return (jax.lax.ppermute(y, axis, forward), out_M, aux_sum), None

  aux_shapes = jax.eval_shape(stage_fn, params, x_M[0], jax.tree.map(lambda e: e[0], extras_M),
                              key)[1]
  aux_zeros = jax.tree.map(lambda s: jax.lax.pcast(jnp.zeros(s.shape, s.dtype), (axis,),
                                                   to="varying"), aux_shapes)
  start = (jnp.zeros_like(x_M[0]), jnp.zeros_like(x_M), aux_zeros)  # Varying over stages.
  (_, out_M, aux_sum), _ = jax.lax.scan(tick, start, jnp.arange(M + S - 1))
  return out_M, aux_sum


def _gather_to_first(x_MGSr: jax.Array, axis: str) -> jax.Array:
  """Inside shard_map: [M, G, 1, r, ...] (each stage its block of every row group) ->
  [M, G S r, ...] on stage 0, which alone reads it (the other stages' copy is not the
  input): S - 1 collective permutes s -> 0, whose transposes send each stage back its
  block's gradient."""
  S, own = jax.lax.axis_size(axis), x_MGSr[:, :, 0]
  got = [own] + [jax.lax.ppermute(own, axis, [(s, 0)]) for s in range(1, S)]
  x_MGSr = jnp.stack(got, axis=2)
  return x_MGSr.reshape(x_MGSr.shape[0], -1, *x_MGSr.shape[4:])


def _scatter_from_last(out_M: jax.Array, groups: int, axis: str) -> jax.Array:
  """Inside shard_map: the last stage's [M, b, ...] -> [M, G, 1, b / (G S), ...], stage
  s's block s of every one of the G row groups: S - 1 collective permutes S - 1 -> s, the
  last stage keeping its own block."""
  S, stage, M = jax.lax.axis_size(axis), jax.lax.axis_index(axis), out_M.shape[0]
  out_MGSr = out_M.reshape(M, groups, S, -1, *out_M.shape[2:])
  mine = out_MGSr[:, :, S - 1]
  for s in range(S - 1):
    mine = jnp.where(stage == s, jax.lax.ppermute(out_MGSr[:, :, s], axis, [(S - 1, s)]),
                     mine)
  return mine[:, :, None]


def stage_map(schedule: Callable[..., tuple[jax.Array, Any]], stacked_params: Any,
              x_M: jax.Array, extras_M: Any, key: jax.Array | None,
              axis: str = AXIS) -> tuple[jax.Array, Any]:
  """schedule(params, x_M, extras_M, key) -> (out_M, aux) run on every stage, `axis`
  manual (the rules in force without it), each stage with its rows of `stacked_params`;
  returns the last stage's out_M [M, b, ...] and aux stacked over the stages ([S, ...]).

  Where the rules split the batch over `axis` (its minor "batch" axis: parallel/rules.py)
  into G row groups and S G divides b, the input arrives split as outside (each stage its
  block of each group) and is gathered onto stage 0, and the last stage scatters the
  output's blocks back to their stages (collective permutes, `_gather_to_first` /
  `_scatter_from_last`): no stage receives rows it does not keep. Otherwise every stage
  gets the whole input (only stage 0 reads it) and GSPMD sends the last stage's output
  where the next op needs it."""
  S, (M, b) = stage_axis_size(axis), x_M.shape[:2]
  G = rules.row_blocks_before(axis)
  G = G if G and b % (G * S) == 0 else 0
  keys = () if key is None else (key,)
  if G:
    x_in, x_spec = x_M.reshape(M, G, S, b // (G * S), *x_M.shape[2:]), P(None, None, axis)
  else:
    # Every stage gets its own copy, so the input's gradient is summed over the stages by
    # GSPMD outside: a replicated input's, summed inside by shard_map, aborts XLA:CPU in
    # bfloat16 (its all-reduce promotion pass).
    x_in, x_spec = jnp.broadcast_to(x_M[None], (S, *x_M.shape)), P(axis)

  def run(params, x, extras, *k):
    with rules.without_axis(axis):  # Manual here: no sharding constraint may name it.
      out_M, aux = schedule(params, _gather_to_first(x, axis) if G else x[0], extras,
                            k[0] if k else None)
      out = _scatter_from_last(out_M, G, axis) if G else out_M[None]
    return out, jax.tree.map(lambda a: a[None], aux)

  specs = (jax.tree.map(lambda _: P(axis), stacked_params), x_spec, jax.tree.map(
      lambda _: P(), extras_M), *(P() for _ in keys))
  out, aux_S = jax.shard_map(run, in_specs=specs, out_specs=(x_spec, P(axis)),
                             axis_names={axis})(stacked_params, x_in, extras_M, *keys)
  return (out.reshape(x_M.shape) if G else out[S - 1]), aux_S


def gpipe(stage_fn: Callable[..., tuple[jax.Array, Any]], stacked_params: Any,
          x_M: jax.Array, extras_M: Any = None, key: jax.Array | None = None,
          axis: str = AXIS) -> tuple[jax.Array, Any]:
  """The layer stack over M microbatches, pipelined over the mesh's `axis` (GPipe).

  stage_fn(params, x, extras, key) -> (y, aux): one stage's layers (`params`: every leaf
  of `stacked_params` cut to this stage's n / S layers) on one microbatch `x` ([b, ...]);
  y has x's shape and dtype; aux is a pytree of what the stage reports (e.g. its layers'
  sown losses and counts; {} for none). `extras`: that microbatch's slice of `extras_M`
  (e.g. its positions); `key`: `key` folded with the microbatch and the stage (None: none).
  x_M: [M, b, ...]; extras_M: a pytree of [M, ...] arrays. Returns the stack's output
  [M, b, ...]: the last stage's, its rows scattered over the stages as the rules split
  them outside (`stage_map`; a psum of the masked outputs inside would broadcast them
  instead, and aborts XLA:CPU in bfloat16); and aux
  summed over each stage's M microbatches (its bubble ticks left out), stacked over the
  stages: every leaf [S, ...] (differentiable: a loss on it back-propagates into the
  stages). Means and other combinations are the caller's."""
  S = stage_axis_size(axis)
  for leaf in jax.tree.leaves(stacked_params):
    if leaf.shape[0] % S:
      raise ValueError(f"a stacked parameter of {leaf.shape[0]} layers cannot be cut into "
                       f"{S} stages: the layers must be divisible by mesh.stage")
  schedule = lambda *a: _schedule(stage_fn, *a, axis)
  return stage_map(schedule, stacked_params, x_M, extras_M, key, axis)

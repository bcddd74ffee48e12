"""The 1F1B pipeline schedule inside jit: forward and backward interleaved per microbatch.

GPipe (parallel/pipeline.py) is a forward scan that JAX differentiates: every stage keeps
the residuals of all M microbatches until the backward scan starts. 1F1B (PipeDream-Flush,
Narayanan et al. 2021; Megatron's and torchtitan's default) starts a microbatch's backward
as soon as the last stage has its loss, so a stage holds only the microbatches in flight
between its forward and its backward: a bound that does not grow with M.

Because the backward must start before the forward ends, the schedule owns the loss: the
caller hands in `tail_fn(tail_params, y, tail_extras) -> (loss, stats)` (final norm, head
and loss of one microbatch, on the last stage) besides `stage_fn`, and `one_f_one_b`
returns the summed loss (and stats, and each stage's aux summed) with its gradient
computed inside the schedule (a `jax.custom_vjp`: the forward pass runs the whole
schedule and keeps the gradients, the backward pass scales them by the loss's
cotangent). A stage's own loss terms (`aux_loss_fn`: an MoE's aux losses) are in the
loss, each differentiated in that stage's own backward of its microbatch.

The schedule runs in half-ticks, one SPMD program: at half-tick h stage s runs the
forward of microbatch (h - s) / 2 where h - s is even, and the backward of microbatch
(h - (2S - 1 - s)) / 2 where it is odd (nothing where that microbatch is not in [0, M)),
chosen by a `lax.switch` on the device's own index. The last stage computes the loss and
its output's cotangent right after a forward (h = S - 1 + 2m) and runs that microbatch's
backward in the next half-tick; stage s runs the backward of m at h = 2S - 1 - s + 2m.
Neighbouring stages are on opposite parities, so in each half-tick every forward stage s
has a backward stage s + 1 above it (if any): the half-tick ends with ONE permute of
swaps (s's activation up, s + 1's input cotangent down; the pairs alternate with h's
parity), outside the switch, in which every device takes part. 2M + 2S - 2 half-ticks
(a `lax.scan` of M + S - 1 pairs). Stage s holds the residuals of the forwards between
h = s + 2m and 2S - 1 - s + 2m: **S - s microbatches**, so a ring of K = min(M, S) slots
(stage 0 uses all; with M < S one spare, `ring_slots`). The price, on chips that run the
stages in lockstep: a half-tick costs the slower of a forward and a backward, so a step
takes about S forwards + (2M + S - 2) backwards of time, against the lockstep schedule's
(M + S - 1) (forward + backward) (parallel/pipeline_1f1b_lockstep.py, which holds up to
2S - 1: `one_f_one_b(..., schedule="1f1b_lockstep")`, train.pipeline_schedule=1f1b_lockstep),
and the zero-bubble schedule's (parallel/pipeline_zero_bubble.py, schedule="zero_bubble").
Residuals that are the stage's parameters themselves are not copied into the ring.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from parallel.pipeline import AXIS, P, stage_axis_size
from parallel.pipeline_1f1b_common import (forward_pass, ones, outputs, parts, pullback,
                                            start, take_loss, varying, whole_vectors)
from parallel.pipeline_1f1b_lockstep import schedule as lockstep_schedule
from parallel.pipeline_zero_bubble import schedule as zero_bubble_schedule

Tail = Callable[[Any, jax.Array, Any], tuple[jax.Array, Any]]


def ring_slots(stages: int, microbatches: int) -> int:
  """The ring's slots: stage 0 holds min(M, S) microbatches' residuals at most; with
  M < S, one spare slot that half-ticks without a forward write (`_slot`)."""
  return stages if microbatches >= stages else microbatches + 1


def _slot(f, b, writes, n: int, M: int):
  """The ring slot a half-tick writes (the switch returns residuals in every half-tick; a
  `where` keeping the old slot's would copy it). A forward: its microbatch's, m mod n.
  Otherwise, with M >= S, the slot of the microbatch m = f / 2 or b / 2 the half-tick
  would run if it existed, mod n = S: free, as for that microbatch's forward or right
  after the backward that read it (the live microbatches lie within S - 1 of m); with
  M < S, where a ring of M could alias a live one, the spare slot M (n = M + 1). A
  parameter-only residual's one slot takes what the branch returns (its copy)."""
  m = jnp.where(f % 2 == 0, f, b) // 2
  if n == 1 or n > M:
    return jnp.where(writes, m, n - 1) if n > 1 else 0
  return m % n


def _pairs(stages: int, parity: int) -> list[tuple[int, int]]:
  """The half-tick's exchange: each stage s that runs a forward (s = h mod 2) sends its
  activation up to s + 1, which runs a backward and sends its input's cotangent down to s:
  one collective permute of swaps, the same in every half-tick of a parity."""
  firsts = range(parity, stages - 1, 2)
  return [(s, s + 1) for s in firsts] + [(s + 1, s) for s in firsts]


def _schedule(*args):
  """One device's part (inside shard_map): pipeline_1f1b_common.outputs; its stage traced
  with the norms' scales whole (`whole_vectors`: a permute would deadlock the switch)."""
  with whole_vectors():
    return _half_ticks(*args)


def _half_ticks(stage_fn, aux_loss_fn, tail_fn, params, tail_params, x_M, extras_M, tail_M,
                key, axis):
  S, M = jax.lax.axis_size(axis), x_M.shape[0]
  stage = jax.lax.axis_index(axis)
  # Each stage's own copy: a replicated input's cotangent would be summed over the stages.
  tail_params = jax.tree.map(lambda a: varying(a, axis), tail_params)
  pick = lambda tree, i: jax.tree.map(lambda a: a[i], tree)
  forward_fn, treedef, source, kept, slots, aux = parts(
      stage_fn, aux_loss_fn, params, x_M, extras_M, key, stage, ring_slots(S, M), axis)
  param_leaves = jax.tree.leaves(params)
  carry = start(kept, slots, aux, params, tail_params, x_M,
                 jax.eval_shape(tail_fn, tail_params, x_M[0], pick(tail_M, 0)), axis,
                 buffers=("recv",))
  zero = varying(jnp.zeros_like(x_M[0]), axis)
  # What a half-tick without a forward writes to the ring: zeros (in a free slot), or a
  # parameter-only residual's one copy as it is.
  no_residuals = lambda ring: [r[0] if n == 1 else varying(jnp.zeros(k.shape, k.dtype), axis)
                               for r, k, n in zip(ring, kept, slots)]

  def forward(c, m, ring):
    x = jnp.where(stage == 0, x_M[m], c["recv"])
    # A forward runs only for a live microbatch.
    y, kept_now = forward_pass(c, forward_fn, params, x, m, source)
    # Typed as varying, as the ring is: a residual of no input's (a constant the layer
    # scan traces) is not, and the switch's branches must return the same types.
    return c, y, zero, [varying(l, axis) for l in kept_now]

  def forward_last(c, m, ring):
    """The last stage: its forward, then the loss of microbatch m and the cotangent of its
    output, kept for its backward in the next half-tick."""
    c, y, _, residuals = forward(c, m, ring)
    dy = take_loss(c, tail_fn, tail_params, pick(tail_M, m), y, m)
    return c, zero, dy, residuals

  def backward(c, m, ring):
    stored = [r[m % n] for r, n in zip(ring, slots)]
    d_params, dx = pullback(treedef, source, param_leaves, stored)((c["recv"], ones(axis)))
    c["grads"] = jax.tree.map(jnp.add, c["grads"], d_params)
    c["dx_M"] = jax.lax.dynamic_update_index_in_dim(
        c["dx_M"], jnp.where(stage == 0, dx, c["dx_M"][m]), m, 0)
    return c, dx, zero, no_residuals(ring)

  idle = lambda c, m, ring: (c, zero, zero, no_residuals(ring))

  def half_tick(c, h, parity: int):
    """Stage s: the forward of microbatch (h - s) / 2 where h - s is even, the backward
    of (h - (2S - 1 - s)) / 2 where it is odd; nothing where that is not in [0, M)."""
    f, b = h - stage, h - (2 * S - 1 - stage)
    runs_forward = f % 2 == 0
    m = jnp.clip(jnp.where(runs_forward, f, b) // 2, 0, M - 1)
    live = jnp.where(runs_forward, (f >= 0) & (f < 2 * M), (b >= 0) & (b < 2 * M))
    branch = jnp.where(~live, 0, jnp.where(runs_forward, jnp.where(stage == S - 1, 2, 1), 3))
    ring = c.pop("ring")
    c, send, keep, residuals = jax.lax.switch(branch, (idle, forward, forward_last, backward),
                                              c, m, ring)
    writes = runs_forward & live
    c["ring"] = [jax.lax.dynamic_update_index_in_dim(r, l, _slot(f, b, writes, n, M), 0)
                 for r, l, n in zip(ring, residuals, slots)]
    pairs = _pairs(S, parity)
    c["recv"] = keep + (jax.lax.ppermute(send, axis, pairs) if pairs else zero)
    return c

  def tick(c, t):  # Two half-ticks: the exchange's pairs alternate with h's parity.
    return half_tick(half_tick(c, 2 * t, 0), 2 * t + 1, 1), None

  carry, _ = jax.lax.scan(tick, carry, jnp.arange(M + S - 1))
  return outputs(carry)


def one_f_one_b(stage_fn: Callable[..., tuple[jax.Array, Any]], tail_fn: Tail,
                stacked_params: Any, tail_params: Any, x_M: jax.Array, extras_M: Any = None,
                tail_M: Any = None, key: jax.Array | None = None, axis: str = AXIS,
                schedule: str = "1f1b", aux_loss_fn: Callable[[Any], jax.Array] | None = None,
                stash: int = 0):
  """(loss, stats_M, aux_S) of the layer stack and its tail over M microbatches,
  pipelined over the mesh's `axis` with the 1F1B schedule: the microbatches' losses
  summed, their stats stacked [M, ...]. Differentiable in stacked_params, tail_params and
  x_M (the gradient is computed inside the schedule; stats and aux carry none).

  stage_fn(params, x, extras, key) -> (y, aux): as `pipeline.gpipe`'s (aux: what the
  stage reports, {} for nothing). aux_loss_fn(aux) -> a scalar: that stage's own term of
  the loss on one microbatch (an MoE's weighted aux losses; None: none), added to the loss
  and differentiated in the stage's backward; it must be what the caller's loss is on the
  whole batch when summed over the microbatches. aux_S: each stage's aux summed over its
  M microbatches, stacked over the stages ([S, ...]). tail_fn(tail_params, y,
  tail_extras) -> (loss, stats): one microbatch's loss (a scalar) and a pytree of arrays
  from the last stage's output y; `tail_extras`: that microbatch's slice of tail_M (a
  pytree of [M, ...]). x_M: [M, b, ...]. schedule: "1f1b" (this module's), "1f1b_lockstep"
  (parallel/pipeline_1f1b_lockstep.py: a forward and a backward per tick, fewer ticks, up
  to 2S - 1 microbatches held) or "zero_bubble" (parallel/pipeline_zero_bubble.py: the
  backward split into B and W, W deferred into the bubble; stash: the microbatches whose W
  a stage may hold back at once, 0: S)."""
  S = stage_axis_size(axis)
  schedules = {"1f1b": _schedule, "1f1b_lockstep": lockstep_schedule,
               "zero_bubble": functools.partial(zero_bubble_schedule, stash=stash)}
  if schedule not in schedules:
    raise ValueError(f"unknown 1F1B-family schedule {schedule!r}: one of {list(schedules)}")
  run_schedule = schedules[schedule]
  aux_loss_fn = aux_loss_fn or (lambda aux: jnp.zeros((), jnp.float32))
  for leaf in jax.tree.leaves(stacked_params):
    if leaf.shape[0] % S:
      raise ValueError(f"a stacked parameter of {leaf.shape[0]} layers cannot be cut into "
                       f"{S} stages: the layers must be divisible by mesh.stage")

  def run(params, tail_params, x_M):
    def device(params, tail_params, x_SM, extras_M, tail_M, *k):
      return run_schedule(stage_fn, aux_loss_fn, tail_fn, params, tail_params, x_SM[0],
                      extras_M, tail_M, k[0] if k else None, axis)

    keys = () if key is None else (key,)
    x_SM = jnp.broadcast_to(x_M[None], (S, *x_M.shape))  # As gpipe: each stage its copy.
    rep = lambda tree: jax.tree.map(lambda _: P(), tree)
    stack = lambda tree: jax.tree.map(lambda _: P(axis), tree)
    specs = (stack(params), rep(tail_params), P(axis), rep(extras_M), rep(tail_M),
             *(P() for _ in keys))
    out = jax.shard_map(device, in_specs=specs, axis_names={axis}, out_specs=(
        stack(params), P(axis), P(axis), P(axis), P(axis), P(axis), P(axis)))(
            params, tail_params, x_SM, extras_M, tail_M, *keys)
    grads, loss_SM, stats_SM, tail_grads_S, dx_SM, aux_loss_S, aux_S = out
    last = lambda tree: jax.tree.map(lambda a: a[S - 1], tree)
    loss = jnp.sum(loss_SM[S - 1])
    loss = loss + jnp.sum(aux_loss_S).astype(loss.dtype)
    return (loss, last(stats_SM), aux_S), (grads, last(tail_grads_S), dx_SM[0])

  @jax.custom_vjp
  def pipelined(params, tail_params, x_M):
    return run(params, tail_params, x_M)[0]

  def fwd(params, tail_params, x_M):
    out, grads = run(params, tail_params, x_M)
    return out, grads

  def bwd(grads, cotangent):
    g = cotangent[0]  # The stats and aux carry no gradient.
    return jax.tree.map(lambda d: (g * d).astype(d.dtype), grads)

  pipelined.defvjp(fwd, bwd)
  loss, stats, aux_S = pipelined(stacked_params, tail_params, x_M)
  return loss, jax.lax.stop_gradient(stats), jax.lax.stop_gradient(aux_S)

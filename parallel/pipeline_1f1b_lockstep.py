"""The lockstep 1F1B schedule (`train.pipeline_schedule=1f1b_lockstep`): every stage runs
one forward and one backward in every tick, so a step costs (M + S - 1) forwards and
(M + S - 1) backwards per stage, but stage s holds 2(S - s) - 1 microbatches' residuals
(a ring of K = min(M, 2S - 1) slots), against parallel/pipeline_1f1b.py's S - s.

Stage s runs the forward of microbatch t - s at tick t and the backward of microbatch
t - (2S - 2 - s); the last stage runs both on the same microbatch in one tick (forward,
loss, backward), and each tick ends with two collective permutes over the stage axis
(activations s -> s + 1, their cotangents s -> s - 1). The M + 2S - 2 ticks are three
scans: S - 1 warm-up ticks with forwards only, M steady ticks with both, S - 1 cool-down
ticks with backwards only. Each hop of a microbatch costs a tick, which holds a forward
and a backward: hence the 2(S - s) - 1 in flight. The caller is
parallel/pipeline_1f1b.py's `one_f_one_b` (schedule="1f1b_lockstep"); the helpers the
schedules share are parallel/pipeline_1f1b_common.py's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from parallel.pipeline_1f1b_common import (forward_pass, ones, outputs, parts, pullback,
                                            start, varying)


def ring_slots(stages: int, microbatches: int) -> int:
  """K: the microbatches whose residuals a stage holds at most (stage 0 uses all K)."""
  return min(microbatches, 2 * stages - 1)


def schedule(stage_fn, aux_loss_fn, tail_fn, params, tail_params, x_M, extras_M, tail_M,
             key, axis):
  """One device's part (inside shard_map): pipeline_1f1b_common.outputs."""
  S, M = jax.lax.axis_size(axis), x_M.shape[0]
  K = ring_slots(S, M)
  stage = jax.lax.axis_index(axis)
  # Each stage's own copy: a replicated input's cotangent would be summed over the stages.
  tail_params = jax.tree.map(lambda a: varying(a, axis), tail_params)
  pick = lambda tree, i: jax.tree.map(lambda a: a[i], tree)
  forward_fn, treedef, source, kept, slots, aux = parts(stage_fn, aux_loss_fn, params, x_M,
                                                         extras_M, key, stage, K, axis)
  param_leaves = jax.tree.leaves(params)
  carry = start(kept, slots, aux, params, tail_params, x_M,
                 jax.eval_shape(tail_fn, tail_params, x_M[0], pick(tail_M, 0)), axis,
                 buffers=("x_in", "dy_in"))
  up, down = [(i, i + 1) for i in range(S - 1)], [(i + 1, i) for i in range(S - 1)]

  def forward(c, t):
    f = t - stage
    live = (f >= 0) & (f < M)
    m = jnp.clip(f, 0, M - 1)
    x = jnp.where(stage == 0, x_M[jnp.clip(t, 0, M - 1)], c["x_in"])
    y, kept_leaves = forward_pass(c, forward_fn, params, x, m, source, live)
    c["ring"] = [jax.lax.dynamic_update_index_in_dim(r, jnp.where(live, l, r[m % n]), m % n, 0)
                 for r, l, n in zip(c["ring"], kept_leaves, slots)]
    c["x_in"] = jax.lax.ppermute(y, axis, up)
    return y, live & (stage == S - 1), m

  def tail(c, y, last, m):
    """The last stage's loss of microbatch m and the cotangent of its output."""
    (loss, stats), pull = jax.vjp(lambda tp, y: tail_fn(tp, y, pick(tail_M, m)),
                                  tail_params, y)
    d_tail, dy = pull((jnp.ones_like(loss), jax.tree.map(jnp.zeros_like, stats)))
    put = lambda a, v: jax.lax.dynamic_update_index_in_dim(a, jnp.where(last, v, a[m]), m, 0)
    c["loss_M"], c["stats_M"] = jax.tree.map(put, (c["loss_M"], c["stats_M"]), (loss, stats))
    c["tail_grads"] = jax.tree.map(lambda g, d: g + jnp.where(last, d, 0), c["tail_grads"],
                                   d_tail)
    return dy

  def backward(c, t, dy_tail):
    b = t - (2 * S - 2 - stage)
    live = (b >= 0) & (b < M)
    m = jnp.clip(b, 0, M - 1)
    stored = [r[m % n] for r, n in zip(c["ring"], slots)]
    dy = c["dy_in"] if dy_tail is None else jnp.where(stage == S - 1, dy_tail, c["dy_in"])
    d_params, dx = pullback(treedef, source, param_leaves, stored)((dy, ones(axis)))
    c["grads"] = jax.tree.map(lambda g, d: g + jnp.where(live, d, 0), c["grads"], d_params)
    first = live & (stage == 0)
    c["dx_M"] = jax.lax.dynamic_update_index_in_dim(
        c["dx_M"], jnp.where(first, dx, c["dx_M"][m]), m, 0)
    c["dy_in"] = jax.lax.ppermute(dx, axis, down)

  def tick(c, t, warm_up: bool, cool_down: bool):
    if cool_down:
      backward(c, t, None)
    else:
      y, last, m = forward(c, t)
      if not warm_up:
        backward(c, t, tail(c, y, last, m))
    return c, None

  phases = ((True, False, 0, S - 1), (False, False, S - 1, M + S - 1),
            (False, True, M + S - 1, M + 2 * S - 2))  # Warm-up, steady, cool-down ticks.
  for warm_up, cool_down, first, end in phases:
    body = lambda c, t, w=warm_up, d=cool_down: tick(c, t, w, d)
    carry, _ = jax.lax.scan(body, carry, jnp.arange(first, end))
  return outputs(carry)

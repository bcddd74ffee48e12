"""The zero-bubble schedule (`train.pipeline_schedule=zero_bubble`; Qi et al. 2023, "Zero
Bubble Pipeline Parallelism", its ZB-H1 memory bound) inside jit.

1F1B's backward is one pass: the input's gradient, which the stage before waits for, and
the weight gradients, which nothing waits for. Here they are two (parallel/backward_split.py):
B, and W deferred into the ticks where 1F1B's stages idle. The timetable
(parallel/pipeline_zero_bubble_plan.py) gives each stage one pass per tick: F, B or W, or
nothing; a `lax.switch` on the device's own index picks it, and each tick ends with up to
two collective permutes outside the switch (activations up, input cotangents down; each
only in the ticks where some stage sends that way), in which every device takes part.
Received values wait in small rings until the pass that reads them; a stage's residuals
stay in a ring from its F to its W where W reads them, else to its B (at most S
microbatches: 1F1B's peak), and what B computed for W (each weight gradient's output
cotangent and, under remat, its recomputed input) in a stash ring from B to W
(`train.pipeline_stash` slots, 0: S).

With the three passes of about equal time (F, B and W each hold one matmul per weight:
an attention's B holds more), a step takes the timetable's ticks: 3M + S - 1 at best,
against 1F1B's lockstep 3 (M + S - 1). The caller is parallel/pipeline_1f1b.py's
`one_f_one_b(..., schedule="zero_bubble")`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from parallel import backward_split
from parallel.pipeline_1f1b_common import (forward_pass, ones, outputs, parts, pullback,
                                            start, take_loss, varying, whole_vectors)
from parallel.pipeline_zero_bubble_plan import plan


def schedule(*args, stash: int = 0):
  """One device's part (inside shard_map): pipeline_1f1b_common.outputs; its stage traced
  with the norms' scales whole (as the half-tick schedule's: no permute in the switch).
  stash: the microbatches whose W a stage may hold back at once (0: S)."""
  with whole_vectors():
    return _ticks(*args, stash)


def _setup(stage_fn, aux_loss_fn, tail_fn, params, tail_params, x_M, extras_M, tail_M, key,
           stage, p, axis):
  """forward_fn and the residuals' sources (pipeline_1f1b_common.parts), the backward's
  split into B and W, per kept residual whether it is kept once (of the parameters alone)
  and its ring's plan (until W where W reads it, else until B), and the carry."""
  pick = lambda tree, i: jax.tree.map(lambda a: a[i], tree)
  # parts' slots: 1 for a residual of the parameters alone, 0 for one the rings keep.
  forward_fn, treedef, source, kept, once, aux = parts(
      stage_fn, aux_loss_fn, params, x_M, extras_M, key, stage, 0, axis)
  zeros = lambda s, lead=(): varying(jnp.zeros((*lead, *s.shape), s.dtype), axis)

  def backward(pl, kl, dy, one):
    d_params, dx = pullback(treedef, source, pl, kl)((dy, one))
    return jax.tree.leaves(d_params), dx

  # The kept residuals typed as the forward made them (varying over the stages or not).
  typed = [zeros(k) if axis in k.manual_axis_type.varying else jnp.zeros(k.shape, k.dtype)
           for k in kept]
  split = backward_split.split(backward, jax.tree.leaves(params), typed, zeros(x_M[0]),
                               ones(axis))
  assert not split.out_in_w[-1], "the input's gradient must be B's"
  if not any(split.out_in_w):
    raise ValueError("the zero-bubble schedule found no weight gradient to defer: the "
                     "stage's parameters get their gradients where its input's is computed")
  rings = [p.residuals if w else p.residuals_b for w in split.kept_in_w]
  slots = [1 if n == 1 else r.slots for n, r in zip(once, rings)]
  carry = start(kept, slots, aux, params, tail_params, x_M,
                jax.eval_shape(tail_fn, tail_params, x_M[0], pick(tail_M, 0)), axis,
                buffers=())
  carry.update(stash=[zeros(s, (p.stash.slots,)) for s in split.stash],
               act=zeros(x_M[0], (p.activations.slots,)),
               cot=zeros(x_M[0], (p.cotangents.slots,)))
  return forward_fn, source, split, once, rings, carry


def _ticks(stage_fn, aux_loss_fn, tail_fn, params, tail_params, x_M, extras_M, tail_M, key,
           axis, stash):
  S, stage = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
  p = plan(S, x_M.shape[0], stash)
  tail_params = jax.tree.map(lambda a: varying(a, axis), tail_params)
  pick = lambda tree, i: jax.tree.map(lambda a: a[i], tree)
  forward_fn, source, split, once, rings, carry = _setup(
      stage_fn, aux_loss_fn, tail_fn, params, tail_params, x_M, extras_M, tail_M, key, stage,
      p, axis)
  param_leaves, params_def = jax.tree.flatten(params)
  zero = varying(jnp.zeros_like(x_M[0]), axis)
  at = lambda a, t: jnp.asarray(a)[t, stage]  # A timetable's entry for this tick and stage.
  # A pass that writes no residuals (or no stash) writes back what its write slot holds:
  # a ring of S slots may have none free (parallel/pipeline_zero_bubble_plan.py `_ring`).
  no_residuals = lambda ring, t: [r[0] if n == 1 else r[at(plan.write_TS, t)]
                                  for r, n, plan in zip(ring, once, rings)]
  no_stash = lambda c, t: [s[at(p.stash.write_TS, t)] for s in c["stash"]]

  def add_grads(c, d_leaves):
    grads = jax.tree.leaves(c["grads"])
    c["grads"] = jax.tree.unflatten(params_def, [g if d is None else g + d
                                                 for g, d in zip(grads, d_leaves)])

  def forward(c, t, ring):
    m = at(p.microbatch_TS, t)
    x = jnp.where(stage == 0, x_M[m], c["act"][at(p.activations.read_TS, t)])
    y, kept_now = forward_pass(c, forward_fn, params, x, m, source)
    return c, y, zero, zero, [varying(l, axis) for l in kept_now], no_stash(c, t)

  def forward_last(c, t, ring):
    """The last stage: its forward, then the microbatch's loss and its output's
    cotangent, kept in the cotangent ring for its B."""
    m = at(p.microbatch_TS, t)
    c, y, _, _, residuals, _ = forward(c, t, ring)
    dy = take_loss(c, tail_fn, tail_params, pick(tail_M, m), y, m)
    return c, zero, zero, dy, residuals, no_stash(c, t)

  def stored(ring, t):
    return [r[0] if n == 1 else r[at(plan.read_TS, t)] for r, n, plan in zip(ring, once, rings)]

  def input_grad(c, t, ring):
    m = at(p.microbatch_TS, t)
    dy = c["cot"][at(p.cotangents.read_TS, t)]
    outs, stash = backward_split.run_b(split, param_leaves, stored(ring, t), dy, ones(axis))
    add_grads(c, outs[:-1])
    dx = outs[-1]
    c["dx_M"] = jax.lax.dynamic_update_index_in_dim(
        c["dx_M"], jnp.where(stage == 0, dx, c["dx_M"][m]), m, 0)
    return c, zero, dx, zero, no_residuals(ring, t), [varying(s, axis) for s in stash]

  def weight_grads(c, t, ring):
    slot = at(p.stash.read_TS, t)
    outs = backward_split.run_w(split, param_leaves, stored(ring, t),
                                [s[slot] for s in c["stash"]])
    add_grads(c, outs[:-1])
    return c, zero, zero, zero, no_residuals(ring, t), no_stash(c, t)

  idle = lambda c, t, ring: (c, zero, zero, zero, no_residuals(ring, t), no_stash(c, t))

  def tick(c, t):
    write = lambda buf, v, ring_plan: jax.lax.dynamic_update_index_in_dim(
        buf, v, at(ring_plan.write_TS, t), 0)
    ring = c.pop("ring")
    c, send_up, send_down, keep_dy, residuals, stash = jax.lax.switch(
        at(p.op_TS, t), (idle, forward, forward_last, input_grad, weight_grads), c, t, ring)
    c["ring"] = [l[None] if n == 1 else write(r, l, plan)
                 for r, l, n, plan in zip(ring, residuals, once, rings)]
    c["stash"] = [write(r, s, p.stash) for r, s in zip(c["stash"], stash)]
    received_up, received_down = _exchange(p, t, send_up, send_down, S, axis)
    c["act"] = write(c["act"], received_up, p.activations)
    c["cot"] = write(c["cot"], keep_dy + received_down, p.cotangents)
    return c, None

  carry, _ = jax.lax.scan(tick, carry, jnp.arange(p.op_TS.shape[0]))
  return outputs(carry)


def _exchange(p, t, send_up, send_down, S: int, axis: str):
  """The tick's activations sent up a stage and input cotangents sent down, received; a
  permute only in the ticks where some stage sends that way (a condition every device
  takes alike, so the collective is under no per-stage branch)."""
  def permute(sends_T, v, pairs):
    if not pairs:
      return jnp.zeros_like(v)
    return jax.lax.cond(jnp.asarray(sends_T)[t], lambda v: jax.lax.ppermute(v, axis, pairs),
                        jnp.zeros_like, v)
  return (permute(p.sends_up_T, send_up, [(s, s + 1) for s in range(S - 1)]),
          permute(p.sends_down_T, send_down, [(s + 1, s) for s in range(S - 1)]))

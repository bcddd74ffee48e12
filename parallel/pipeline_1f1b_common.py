"""What the 1F1B-family schedules (parallel/pipeline_1f1b.py,
parallel/pipeline_1f1b_lockstep.py, parallel/pipeline_zero_bubble.py) build the same way:
the layout of a stage's residuals (which the rings keep), the carry, and the stage's
forward as `jax.vjp` differentiates it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax._src.interpreters import partial_eval as pe  # No public API splits a jaxpr so.


_WHOLE: list[bool] = []  # Non-empty while a half-tick schedule traces its stages.


@contextlib.contextmanager
def whole_vectors():
  """While the half-tick 1F1B schedule (parallel/pipeline_1f1b.py) traces its stage, norms
  use their [D] scale whole (model/layers.py `Norm`): moved from the parameter's fsdp split
  to the activations' tensor split it is a collective-permute, which every device must
  join, inside a `lax.switch` whose other branch the other stages run: XLA:CPU deadlocks
  at its rendezvous. Only there: elsewhere the whole scale let GSPMD widen the
  activations beside it (the 405b row: 6 GiB more temporaries per chip)."""
  _WHOLE.append(True)
  try:
    yield
  finally:
    _WHOLE.pop()


def vectors_whole() -> bool:
  """Whether a stage is being traced inside `whole_vectors`."""
  return bool(_WHOLE)


def residual_layout(forward_fn: Callable, params, x, m):
  """jax.vjp(forward_fn(m), params, x, has_aux=True)'s pullback as a pytree: its treedef,
  and per leaf the index of the parameter leaf it is (None: a residual the ring must
  keep), with the kept leaves' shapes, and the shapes of the stage's aux. Traced only
  (eval_shape): nothing of it runs. x and m must be typed as the schedule's (varying over
  the stages), or the trace, and its residuals, differ."""
  layout = {}

  def probe(p, x, m):
    _, vjp, layout["aux"] = jax.vjp(forward_fn(m), p, x, has_aux=True)
    leaves, layout["treedef"] = jax.tree.flatten(vjp)
    layout["source"] = sources(leaves, p)
    return [l for l, s in zip(leaves, layout["source"]) if s is None]

  closed = jax.make_jaxpr(probe)(params, x, m)
  kept = jax.eval_shape(probe, params, x, m)
  # Which kept residuals depend on the microbatch (x, m) and which on the parameters alone
  # (their casts and reshapes, the same in every tick): JAX's own partial evaluation,
  # the split `jax.linearize` makes, with the parameters known.
  n_params = len(jax.tree.leaves(params))
  unknowns = [False] * n_params + [True] * (len(closed.in_avals) - n_params)
  _, _, varies, _ = pe.partial_eval_jaxpr_nounits(closed, unknowns, instantiate=False)
  aux = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), layout["aux"])
  return layout["treedef"], layout["source"], kept, varies, aux


def sources(leaves, params) -> list[int | None]:
  param_leaves = jax.tree.leaves(params)
  return [next((j for j, q in enumerate(param_leaves) if leaf is q), None) for leaf in leaves]


def varying(a: jax.Array, axis: str) -> jax.Array:
  """`a` typed as varying over the stage axis (a scan carry's type must not change)."""
  return a if axis in jax.typeof(a).manual_axis_type.varying else jax.lax.pcast(a, (axis,), to="varying")


def start(kept, slots: list[int], aux, params, tail_params, x_M, tail_out, axis: str,
          buffers: tuple[str, ...]) -> dict:
  """The schedule's carry, zeros typed as varying over the stages: the received
  activation and cotangent, the residual ring ([K, ...], or [1, ...] for a parameter-only
  leaf), the gradient sums, the input's gradient [M, ...], the last stage's losses [M] and
  stats [M, ...], and the stage's own loss terms and aux summed over its microbatches."""
  M = x_M.shape[0]
  zeros = lambda s, lead=(): jnp.zeros((*lead, *s.shape), s.dtype)
  loss, stats = tail_out
  carry = dict(**{b: zeros(x_M[0]) for b in buffers},
               ring=[zeros(s, (n,)) for s, n in zip(kept, slots)],
               grads=jax.tree.map(zeros, params), tail_grads=jax.tree.map(zeros, tail_params),
               dx_M=zeros(x_M), loss_M=zeros(loss, (M,)),
               stats_M=jax.tree.map(lambda s: zeros(s, (M,)), stats),
               aux_loss=jnp.zeros((), jnp.float32), aux_sum=jax.tree.map(zeros, aux))
  return jax.tree.map(lambda a: varying(a, axis), carry)


def ones(axis: str) -> jax.Array:
  """The cotangent of a stage's own loss term (forward_fn's second output)."""
  return varying(jnp.ones((), jnp.float32), axis)


def forward_pass(c: dict, forward_fn, params, x, m, source, live=True):
  """A stage's forward of microbatch m: its output and the residuals the rings keep (the
  pullback's leaves that are not the parameters), its own loss term and aux added to the
  carry's sums where `live`."""
  (y, aux_loss), vjp, aux = jax.vjp(forward_fn(m), params, x, has_aux=True)
  add_aux(c, aux_loss, aux, live)
  leaves = jax.tree.leaves(vjp)
  assert sources(leaves, params) == source, "the stage's residuals changed between traces"
  return y, [l for l, s in zip(leaves, source) if s is None]


def pullback(treedef, source, param_leaves, kept):
  """The stage's pullback rebuilt from its parameters and the kept residuals."""
  stored = iter(kept)
  return jax.tree.unflatten(treedef, [param_leaves[s] if s is not None else next(stored)
                                      for s in source])


def add_aux(c: dict, aux_loss: jax.Array, aux, live) -> None:
  """Adds a forward's own loss term and aux to the stage's sums where `live`."""
  keep = lambda a: jnp.where(live, a, jnp.zeros_like(a))
  c["aux_loss"] = c["aux_loss"] + keep(aux_loss)
  c["aux_sum"] = jax.tree.map(lambda acc, a: acc + keep(a), c["aux_sum"], aux)


def take_loss(c: dict, tail_fn, tail_params, tail_extras, y, m) -> jax.Array:
  """The last stage's loss of microbatch m from its output y: the loss and stats into
  the carry's row m, the tail's gradients summed; returns y's cotangent."""
  (loss, stats), pull = jax.vjp(lambda tp, y: tail_fn(tp, y, tail_extras), tail_params, y)
  d_tail, dy = pull((jnp.ones_like(loss), jax.tree.map(jnp.zeros_like, stats)))
  put = lambda a, v: jax.lax.dynamic_update_index_in_dim(a, v, m, 0)
  c["loss_M"], c["stats_M"] = jax.tree.map(put, (c["loss_M"], c["stats_M"]), (loss, stats))
  c["tail_grads"] = jax.tree.map(jnp.add, c["tail_grads"], d_tail)
  return dy


def outputs(c: dict) -> tuple:
  """What a schedule returns from its final carry: its stage's parameter gradients, and
  [1, ...] stacks of the losses [M], stats [M, ...], the tail's gradients (the last
  stage's count), the input's gradient [M, ...] (stage 0's), the stage's own loss terms
  and its aux sums."""
  lift = lambda tree: jax.tree.map(lambda a: a[None], tree)
  return (c["grads"], lift(c["loss_M"]), lift(c["stats_M"]), lift(c["tail_grads"]),
          c["dx_M"][None], lift(c["aux_loss"]), lift(c["aux_sum"]))


def parts(stage_fn, aux_loss_fn, params, x_M, extras_M, key, stage, K: int, axis: str):
  """What both 1F1B schedules build first: forward_fn(m) (the stage's layers on
  microbatch m, as `jax.vjp(..., has_aux=True)` differentiates them: ((y, the stage's own
  loss term aux_loss_fn(aux)), aux)), the residuals' treedef and sources
  (`residual_layout`), each kept residual's ring slots (K, or 1 for one that depends on
  the parameters alone: one copy) and the aux's shapes."""
  M = x_M.shape[0]
  pick = lambda tree, i: jax.tree.map(lambda a: a[i], tree)

  def forward_fn(m):
    k = None if key is None else jax.random.fold_in(jax.random.fold_in(key, m), stage)

    def fn(p, x):
      y, aux = stage_fn(p, x, pick(extras_M, m), k)
      # Varying over the stages, as the schedules' cotangent for it (`ones`) is typed.
      return (y, varying(jnp.asarray(aux_loss_fn(aux), jnp.float32), axis)), aux
    return fn

  treedef, source, kept, varies, aux = residual_layout(forward_fn, params, x_M[0],
                                                       jnp.clip(-stage, 0, M - 1))
  return forward_fn, treedef, source, kept, [K if v else 1 for v in varies], aux

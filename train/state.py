"""TrainState: everything a step reads and writes, and everything a checkpoint holds.

Built in one place, `make_state`: `init_state` (fresh parameters) and an import
(converted weights, train/checkpoint.py's save_imported) derive the RNG from
`train.seed` the same way, so an imported run and a fresh one differ only in
their parameters.

`PipelineOrder`: with the circular pipeline schedule (train.pipeline_repeats > 1) the
trainer holds the layer stacks' rows in that schedule's order, checkpoints in layer order.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from model import ModelConfig, Transformer
from model.moe.dispatch import LOCAL_EQUIVALENT
from parallel import pipeline_circular
from parallel.pipeline import AXIS
from train import spikes

# Variable collections that are per-call outputs, not state.
TRANSIENT_COLLECTIONS = ("params", "aux", "cache", "intermediates", "telemetry")
# Dispatches whose init forward pass would need a mesh (all_to_all over "expert"),
# and the local dispatch that gives the same parameters (dispatch is a function,
# not a module: the parameter tree does not depend on it).


@struct.dataclass
class TrainState:
  step: jax.Array  # Completed optimizer steps (int32 scalar).
  params: Any
  opt_state: Any
  model_state: Any  # Non-trained collections, e.g. {"moe_state": router biases}.
  rng: jax.Array  # Base key (raw uint32); step t uses fold_in(rng, t).
  skipped_steps: jax.Array  # Updates skipped for a non-finite loss or gradient.
  first_nonfinite_step: jax.Array  # First such step, -1 if none.
  # Train losses of the last spikes.LOSS_HISTORY steps (step t at slot t % LOSS_HISTORY,
  # NaN: none yet): the loss-spike detector's window (train/spikes.py).
  recent_loss: jax.Array


def _keys(seed: int) -> tuple[jax.Array, jax.Array]:
  """(parameter-init key, the state's base RNG) of `train.seed`."""
  params_key, rng = jax.random.split(jax.random.PRNGKey(seed))
  return params_key, rng


def make_state(params: Any, model_state: Any, optimizer: optax.GradientTransformation,
               seed: int) -> TrainState:
  """A step-0 state around `params` (boxed or not): fresh optimizer state, counters."""
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=optimizer.init(params), model_state=model_state or {},
                    rng=_keys(seed)[1], skipped_steps=jnp.zeros((), jnp.int32),
                    first_nonfinite_step=jnp.full((), -1, jnp.int32),
                    recent_loss=spikes.empty_history())


def init_state(model_cfg: ModelConfig, optimizer: optax.GradientTransformation, seed: int,
               seq_len: int) -> TrainState:
  """A fresh state with boxed (logically named) leaves: pass it to
  `parallel.sharded_init` (eval_shape -> shardings -> jit with out_shardings).

  The init forward pass runs on a dummy batch of one row, so an expert-parallel
  dispatch (which splits the batch over the mesh's expert axis) initialises with
  its local equivalent: same parameters, no mesh constraint on a dummy batch.
  """
  init_cfg = model_cfg.replace(
      moe_dispatch=LOCAL_EQUIVALENT.get(model_cfg.moe_dispatch, model_cfg.moe_dispatch))
  tokens_BL = jnp.zeros((1, seq_len), jnp.int32)
  variables = Transformer(init_cfg).init({"params": _keys(seed)[0]}, tokens_BL)
  model_state = {k: v for k, v in variables.items() if k not in TRANSIENT_COLLECTIONS}
  return make_state(variables["params"], model_state, optimizer, seed)


def _splits_stages(sharding: Any) -> bool:
  spec = getattr(sharding, "spec", None)
  if not spec:
    return False
  first = spec[0]
  return first == AXIS or (isinstance(first, tuple) and AXIS in first)


class PipelineOrder:
  """The row order of one run's stacked state leaves (`shardings`: the TrainState's
  NamedShardings): the trainer's state with its layer stacks in the circular pipeline's
  order, and back; identity unless the run trains with the circular schedule.

  With train.pipeline_repeats = R > 1 the circular schedule (parallel/pipeline_circular.py)
  needs stage s to hold the layer chunks s, s + S, ..., while the stacked leaves split over
  "stage" contiguously. So while it trains, the trainer keeps those leaves' rows in pipeline
  order (the parameters and everything shaped like them: the optimizer's moments), and in
  layer order everywhere else:

    init / restore  -> `to_pipeline` (once; the rows move between stages once)
    train and eval steps read the pipeline order (the loop's Evaluator is told R)
    every checkpoint save (the orbax tier and the local tier) -> `to_layers` (a copy)

  Checkpoints therefore stay in layer order, independent of the stage count and of R: a run
  saved with R = 2 resumes with R = 1, other stages, or none, and every reader (load_run,
  --mode eval / generate, export, convert) sees layer order. A save holds one extra copy of
  the stacked leaves on the device until orbax has copied it to the host.

  Which leaves: those whose sharding splits their first dimension over "stage" (only the
  "layers" logical axis maps to it, parallel/rules.py).
  """

  def __init__(self, shardings: Any, stages: int, repeats: int):
    self.stages, self.repeats = stages, repeats
    self.active = stages > 1 and repeats > 1
    leaves, self._treedef = jax.tree.flatten(shardings)
    self._which = [i for i, s in enumerate(leaves) if _splits_stages(s)]
    out = [leaves[i] for i in self._which]
    perm = lambda f: lambda xs: [f(x, stages, repeats) for x in xs]
    self._to_pipeline = jax.jit(perm(pipeline_circular.to_pipeline_order),
                                out_shardings=out, donate_argnums=0)
    self._to_layers = jax.jit(perm(pipeline_circular.to_layer_order), out_shardings=out)

  @classmethod
  def for_run(cls, session: Any) -> PipelineOrder:
    """The order of `session`'s trainer (train/lifecycle/session.py Session)."""
    return cls(session.shardings, int(session.mesh.shape.get(AXIS, 1)),
               int(session.spec.train.pipeline_repeats))

  def _apply(self, fn, state: Any) -> Any:
    if not self.active:
      return state
    leaves = self._treedef.flatten_up_to(state)
    for i, x in zip(self._which, fn([leaves[i] for i in self._which])):
      leaves[i] = x
    return self._treedef.unflatten(leaves)

  def to_pipeline(self, state: Any) -> Any:
    """A state in layer order (initialised or restored) -> the trainer's (donated)."""
    return self._apply(self._to_pipeline, state)

  def to_layers(self, state: Any) -> Any:
    """The trainer's state -> a copy in layer order, what a checkpoint holds."""
    return self._apply(self._to_layers, state)

"""TrainState: everything a step reads and writes, and everything a checkpoint holds.

Built in one place, `make_state`: `init_state` (fresh parameters) and an import
(converted weights, train/checkpoint.py's save_imported) derive the RNG from
`train.seed` the same way, so an imported run and a fresh one differ only in
their parameters.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from model import ModelConfig, Transformer
from model.moe.dispatch import LOCAL_EQUIVALENT
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


"""TrainState: everything a step reads and writes, and everything a checkpoint holds."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from model import ModelConfig, Transformer

# Variable collections that are per-call outputs, not state.
TRANSIENT_COLLECTIONS = ("params", "aux", "cache", "intermediates")


@struct.dataclass
class TrainState:
  step: jax.Array  # Completed optimizer steps (int32 scalar).
  params: Any
  opt_state: Any
  model_state: Any  # Non-trained collections, e.g. {"moe_state": router biases}.
  rng: jax.Array  # Base key (raw uint32); step t uses fold_in(rng, t).
  skipped_steps: jax.Array  # Updates skipped for a non-finite loss or gradient.
  first_nonfinite_step: jax.Array  # First such step, -1 if none.


def init_state(model_cfg: ModelConfig, optimizer: optax.GradientTransformation, seed: int,
               seq_len: int) -> TrainState:
  """A fresh state with boxed (logically named) leaves; wrap in sharded_init."""
  params_key, rng = jax.random.split(jax.random.PRNGKey(seed))
  tokens_BL = jnp.zeros((1, seq_len), jnp.int32)
  variables = Transformer(model_cfg).init({"params": params_key}, tokens_BL)
  params = variables["params"]
  model_state = {k: v for k, v in variables.items() if k not in TRANSIENT_COLLECTIONS}
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=optimizer.init(params), model_state=model_state, rng=rng,
                    skipped_steps=jnp.zeros((), jnp.int32),
                    first_nonfinite_step=jnp.full((), -1, jnp.int32))

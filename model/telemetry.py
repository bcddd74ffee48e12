"""Stability telemetry sown by the forward pass: what a layer already computes, reduced.

A module sows into the "telemetry" collection only when the caller made it mutable
(train.telemetry: train/telemetry.py turns the sown values into the step's per-layer
metrics), never at init; otherwise nothing is computed. Scanned stacks stack the values
over layers like every per-layer collection (model/block.py's LAYER_COLLECTIONS).
Values are float32 scalars without gradient: a max ("_max") or a mean square ("_ms",
over every position of the batch and the model width), so micro-batches combine
exactly (max of maxes, mean of equal-size means) and the trainer takes the root.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

COLLECTION = "telemetry"


def enabled(module: nn.Module) -> bool:
  return module.is_mutable_collection(COLLECTION) and not module.is_initializing()


def sow(module: nn.Module, name: str, value: jax.Array) -> None:
  module.sow(COLLECTION, name, jax.lax.stop_gradient(jnp.asarray(value, jnp.float32)))


def mean_square(x: jax.Array) -> jax.Array:
  return jnp.mean(jnp.square(x.astype(jnp.float32)))


def sow_max_logit(module: nn.Module, out_and_max) -> jax.Array:
  """Sows a `with_max` attention implementation's max logit (model/attention/impls.py's
  layer_impl; None where it cannot report one) as "attn_logit_max"; returns the output."""
  out, max_logit = out_and_max
  if max_logit is not None:
    sow(module, "attn_logit_max", max_logit)
  return out

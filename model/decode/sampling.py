"""Next-token sampling: greedy, temperature, top-k and top-p (nucleus).

The controls are traced (`Sampling` holds arrays), so one compiled decode loop
serves every setting (model/decode/loop.py).
"""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp


class Sampling(NamedTuple):
  """Sampling controls, traced (one compile serves every setting)."""

  temperature: jax.Array  # 0: greedy (argmax).
  top_k: jax.Array  # 0: off; else keep the k most likely tokens.
  top_p: jax.Array  # 1: off; else the smallest set of mass >= top_p (nucleus).

  @classmethod
  def make(cls, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> Sampling:
    if not temperature >= 0:
      raise ValueError(f"temperature={temperature!r}: must be >= 0 (0 = greedy)")
    if int(top_k) != top_k or top_k < 0:
      raise ValueError(f"top_k={top_k!r}: must be an integer >= 0 (0 = off)")
    if not 0 < top_p <= 1:
      raise ValueError(f"top_p={top_p!r}: must be in (0, 1] (1 = off)")
    return cls(jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p))


def sample(logits_BV: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
  """Next token_B: argmax at temperature 0, else temperature + top-k + top-p.

  Sampling is argmax(logits / temperature + Gumbel noise) over the kept
  tokens (the Gumbel-max trick, as jax.random.categorical): one noise draw
  serves both the filtered and the plain branch.
  """
  chex.assert_rank(logits_BV, 2)
  V = logits_BV.shape[-1]

  def greedy():
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)

  def stochastic():
    noisy_BV = logits_BV / sampling.temperature + jax.random.gumbel(key, logits_BV.shape)

    def plain():
      return jnp.argmax(noisy_BV, axis=-1).astype(jnp.int32)

    def filtered():
      # Filter in sorted order (stable: ties go to the lower id, as argmax),
      # so top-k keeps exactly k tokens and the top token survives top-p.
      order_BV = jnp.argsort(-logits_BV, axis=-1, stable=True)
      sorted_BV = jnp.take_along_axis(logits_BV, order_BV, axis=-1) / sampling.temperature
      rank_1V = jnp.arange(V)[None]
      keep_BV = rank_1V < jnp.where(sampling.top_k > 0, sampling.top_k, V)
      probs_BV = jax.nn.softmax(jnp.where(keep_BV, sorted_BV, -jnp.inf), axis=-1)
      mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
      keep_BV &= (mass_before_BV < sampling.top_p) | (rank_1V == 0)
      noisy_sorted_BV = jnp.take_along_axis(noisy_BV, order_BV, axis=-1)
      choice_B = jnp.argmax(jnp.where(keep_BV, noisy_sorted_BV, -jnp.inf), axis=-1)
      return jnp.take_along_axis(order_BV, choice_B[:, None], axis=-1)[:, 0].astype(jnp.int32)

    return jax.lax.cond((sampling.top_k > 0) | (sampling.top_p < 1), filtered, plain)

  return jax.lax.cond(sampling.temperature > 0, stochastic, greedy)

"""Scoring token sequences with a model: the one forward pass that every task shares.

`Scorer.score(rows)` takes (tokens, n_scored) pairs and returns, per row, the summed
log-probability of its last n_scored tokens (each given all tokens before it) and
whether each of them is the model's greedy (argmax) choice. Rows are padded on the
right (causal attention never sees the padding) to a few bucket lengths and a fixed
batch, so a whole evaluation compiles once per bucket, not once per request.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np

from model import ModelConfig, Transformer


@functools.partial(jax.jit, static_argnames=("cfg",))
def token_logprobs(cfg: ModelConfig, variables: Any, inputs_BL: jax.Array,
                   targets_BL: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(log p(target | inputs so far) [B, L] float32, target == argmax [B, L] bool)."""
  chex.assert_equal_shape([inputs_BL, targets_BL])
  logits_BLV, _ = Transformer(cfg).apply(variables, inputs_BL, mutable=["aux"])
  logits_BLV = logits_BLV.astype(jnp.float32)
  logp_BLV = jax.nn.log_softmax(logits_BLV, axis=-1)
  logp_BL = jnp.take_along_axis(logp_BLV, targets_BL[..., None], axis=-1)[..., 0]
  return logp_BL, jnp.argmax(logits_BLV, axis=-1) == targets_BL


def bucket_length(n: int, min_len: int, max_len: int) -> int:
  """n rounded up to min_len * 2^k, at most max_len: a handful of shapes to compile."""
  b = max(1, int(min_len))
  while b < n:
    b *= 2
  return min(b, max_len) if n <= max_len else n


class Scorer:
  """Batched log-likelihoods of token rows under one model.

  `max_len`: the longest row (tokens) the model takes; callers truncate their
  contexts to it (the harness adapter, from the left). Learned position tables
  refuse longer rows before compiling.
  """

  def __init__(self, cfg: ModelConfig, variables: Any, batch_size: int = 16,
               max_len: int | None = None, min_bucket: int = 64):
    self.cfg, self.variables = cfg, variables
    self.batch_size = int(batch_size)
    self.max_len = int(max_len or cfg.max_seq_len)
    self.min_bucket = int(min_bucket)
    if self.batch_size < 1:
      raise ValueError(f"batch_size={batch_size}: must be >= 1")

  def check_length(self, n: int, what: str) -> None:
    if self.cfg.pos_encoding == "learned" and n > self.cfg.max_seq_len:
      raise ValueError(
          f"{what}: {n} tokens exceed ModelConfig.max_seq_len={self.cfg.max_seq_len}, the "
          "size of the learned position table; evaluate at lengths up to max_seq_len")

  def score(self, rows: Sequence[tuple[Sequence[int], int]]) -> list[tuple[float, bool]]:
    """Per (tokens, n_scored): (sum log p of the last n_scored tokens, all greedy).

    tokens[0] is never scored (nothing precedes it): n_scored < len(tokens).
    """
    for i, (toks, n) in enumerate(rows):
      if not 0 < n < len(toks):
        raise ValueError(f"row {i}: scores {n} of {len(toks)} tokens; need "
                         "0 < n_scored < len(tokens) (the first token is only context)")
      self.check_length(len(toks) - 1, f"row {i}")
    out: list[tuple[float, bool] | None] = [None] * len(rows)
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))  # Longest first.
    for lo in range(0, len(order), self.batch_size):
      chunk = order[lo:lo + self.batch_size]
      L = bucket_length(len(rows[chunk[0]][0]) - 1, self.min_bucket, self.max_len)
      inputs_BL = np.zeros((self.batch_size, L), np.int32)
      targets_BL = np.zeros((self.batch_size, L), np.int32)
      for r, i in enumerate(chunk):
        toks = np.asarray(rows[i][0], np.int32)
        inputs_BL[r, :len(toks) - 1] = toks[:-1]
        targets_BL[r, :len(toks) - 1] = toks[1:]
      logp_BL, greedy_BL = jax.device_get(
          token_logprobs(self.cfg, self.variables, inputs_BL, targets_BL))
      for r, i in enumerate(chunk):
        toks, n = rows[i]
        end = len(toks) - 1
        out[i] = (float(np.sum(logp_BL[r, end - n:end], dtype=np.float64)),
                  bool(np.all(greedy_BL[r, end - n:end])))
    return out  # type: ignore[return-value]

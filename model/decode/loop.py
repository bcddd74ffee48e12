"""The jitted prefill and decode loop over the KV cache.

Host-side generation (prompt padding, timing, trimming the results) is
train/generate.py's `generate`; sampling is model/decode/sampling.py.

Every prompt batch is LEFT-aligned: row b's n_b tokens fill the last n_b of L
slots with positions 0..n_b-1 and segment id 1; pad slots get segment id 0,
which the attention mask keeps apart from real tokens. So every row's last
prompt token is in slot L-1, each decode step writes one slot shared by the
batch (the cache `index`), and each row keeps its own true position for the
positional encoding (RoPE angle, ALiBi distance, learned/sinusoidal row).
`left_align` converts right- (or any other) padding.

The cache holds L + max_new_tokens - 1 slots, allocated once (a local layer's,
one of ModelConfig.attention_pattern's "local" kind: a ring of its window;
model/decode/cache.py; an MLA layer's holds only latent rows, model/attention/mla.py); a step
attends over all of them (masked), so the cost per step is constant over a
generation and the whole decode loop is one
`lax.while_loop` with the cache donated, carrying a `DecodeState`. A cache
larger than the device's free memory is refused before compiling, naming the
largest max_new_tokens that fits (train/decode_memory.py `check_cache_memory`, host side).

Layers run unrolled while decoding (`decode_config`: scan_layers=False; the
stacked weights of a scanned model are sliced per layer inside the jit). A
scanned stack carries the cache as scan input and output, which rewrites the
whole cache every step, so a step slowed with the cache's length
(docs/PERFORMANCE.md, "Figures moved from the code"); unrolled, each step writes
only its slot.
Public functions take the model's own config and variables.

rope_scaling="dynamic_ntk" rescales by the largest position in each call (as
Hugging Face does with a cache), so past the original context a row's
continuation can depend on the longest row of its batch.
"""

from __future__ import annotations

import functools
from typing import Any

import chex
import flax.struct
import jax
import jax.numpy as jnp

from model.config import ModelConfig
from model.decode.cache import decode_config, init_cache, unstack_layers
from model.decode.sampling import Sampling, sample
from model.transformer import Transformer

PAD = -1  # tokens_BT entry for "no token": after the row's EOS, or never reached.


@flax.struct.dataclass
class DecodeState:
  """What the decode `while_loop` carries from one step to the next."""

  step: jax.Array  # [] int32: the next token's index t in tokens_BT.
  cache: Any  # The KV cache (model/decode/cache.py cache_shapes), donated.
  tok_B: jax.Array  # [B] int32: the token just sampled, the next step's input.
  pos_B: jax.Array  # [B] int32: tok_B's position in its row.
  done_B: jax.Array  # [B] bool: the row has emitted EOS.
  tokens_BT: jax.Array  # [B, T] int32: sampled ids, PAD after a row's EOS.
  logits_BTV: jax.Array  # [B, T, V] float32 if return_logits, else [0].


def left_align(tokens_BL: jax.Array, valid_BL: jax.Array
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Any padding -> left padding: (tokens_BL, positions_BL, segment_ids_BL).

  Valid tokens keep their order (stable sort); positions count valid tokens
  only, so a row's positions are 0..n_b-1 whatever its padding was.
  """
  chex.assert_equal_shape([tokens_BL, valid_BL])
  order_BL = jnp.argsort(valid_BL.astype(jnp.int32), axis=1, stable=True)
  tokens_BL = jnp.take_along_axis(tokens_BL, order_BL, axis=1)
  segment_ids_BL = jnp.take_along_axis(valid_BL.astype(jnp.int32), order_BL, axis=1)
  positions_BL = jnp.maximum(jnp.cumsum(segment_ids_BL, axis=1) - 1, 0)
  return tokens_BL, positions_BL, segment_ids_BL


def check_length(cfg: ModelConfig, prompt_len: int, max_new_tokens: int) -> None:
  """Learned positions have max_seq_len rows: fail before compiling, not with NaNs."""
  if int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens!r}: must be an integer >= 1")
  if cfg.pos_encoding == "learned" and prompt_len + max_new_tokens > cfg.max_seq_len:
    raise ValueError(
        f"prompt length {prompt_len} + max_new_tokens {max_new_tokens} exceeds "
        f"ModelConfig.max_seq_len={cfg.max_seq_len}, the size of the learned position "
        "table; shorten the prompt or lower max_new_tokens")


@functools.partial(jax.jit, static_argnames=("cfg", "cache_len"))
def prefill(cfg: ModelConfig, variables: Any, tokens_BL: jax.Array, valid_BL: jax.Array,
            cache_len: int) -> tuple[Any, jax.Array, jax.Array]:
  """All prompts in one call -> (cache with index L, last logits_BV, next_pos_B)."""
  B, L = tokens_BL.shape
  if cache_len < L:
    raise ValueError(f"cache_len={cache_len} is shorter than the prompts ({L})")
  tokens_BL, positions_BL, segment_ids_BL = left_align(tokens_BL, valid_BL)
  variables = unstack_layers(cfg, variables)
  logits_BLV, mutated = Transformer(decode_config(cfg)).apply(
      {**variables, "cache": init_cache(cfg, B, cache_len)}, tokens_BL, positions_BL,
      segment_ids_BL, decode=True, mutable=["cache"])
  return mutated["cache"], logits_BLV[:, -1], jnp.sum(segment_ids_BL, axis=1)


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "return_logits"),
                   donate_argnames=("cache",))
def decode(cfg: ModelConfig, variables: Any, cache: Any, logits_BV: jax.Array,
           next_pos_B: jax.Array, key: jax.Array, sampling: Sampling, eos_id: jax.Array,
           *, max_new_tokens: int, return_logits: bool = False) -> dict[str, Any]:
  """Samples max_new_tokens per row, one model step per token, in one while_loop.

  Returns {"tokens_BT": ids, PAD after a row's EOS; "cache"; "logits_BTV" if
  return_logits: the logits each token was sampled from}. Stops early once
  every row has emitted `eos_id` (-1: never). Step t samples with
  fold_in(key, t), so a seed fixes the text.
  """
  B, V = logits_BV.shape
  T = max_new_tokens
  chex.assert_shape(next_pos_B, (B,))
  variables = unstack_layers(cfg, variables)
  net = Transformer(decode_config(cfg))
  segment_ids_B1 = jnp.ones((B, 1), jnp.int32)

  def emit(s: DecodeState, logits_BV: jax.Array) -> DecodeState:
    """Samples token s.step from logits_BV and records it."""
    tok_B = sample(logits_BV, jax.random.fold_in(key, s.step), sampling)
    tokens_BT = s.tokens_BT.at[:, s.step].set(jnp.where(s.done_B, PAD, tok_B))
    logits_BTV = s.logits_BTV.at[:, s.step].set(logits_BV) if return_logits else s.logits_BTV
    return s.replace(step=s.step + 1, tok_B=tok_B, done_B=s.done_B | (tok_B == eos_id),
                     tokens_BT=tokens_BT, logits_BTV=logits_BTV)

  def cond(s: DecodeState) -> jax.Array:
    return (s.step < T) & ~jnp.all(s.done_B)

  def body(s: DecodeState) -> DecodeState:
    logits_B1V, mutated = net.apply({**variables, "cache": s.cache}, s.tok_B[:, None],
                                    s.pos_B[:, None], segment_ids_B1, decode=True,
                                    mutable=["cache"])
    s = s.replace(cache=mutated["cache"], pos_B=s.pos_B + 1)
    return emit(s, logits_B1V[:, 0])

  # Token 0 comes from the prefill logits: the loop starts at step 1, pos next_pos_B.
  start = DecodeState(
      step=jnp.int32(0), cache=cache, tok_B=jnp.zeros((B,), jnp.int32), pos_B=next_pos_B,
      done_B=jnp.zeros((B,), bool), tokens_BT=jnp.full((B, T), PAD, jnp.int32),
      logits_BTV=jnp.zeros((B, T, V) if return_logits else (0,), jnp.float32))
  end = jax.lax.while_loop(cond, body, emit(start, logits_BV))
  out = {"tokens_BT": end.tokens_BT, "cache": end.cache}
  if return_logits:
    out["logits_BTV"] = end.logits_BTV
  return out

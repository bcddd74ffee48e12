"""Prefill and incremental decoding with the KV cache; sampling.

Every prompt batch is LEFT-aligned: row b's n_b tokens fill the last n_b of P
slots with positions 0..n_b-1 and segment id 1; pad slots get segment id 0,
which the attention mask keeps apart from real tokens. So every row's last
prompt token is in slot P-1, each decode step writes one slot shared by the
batch (the cache `index`), and each row keeps its own true position for the
positional encoding (RoPE angle, ALiBi distance, learned/sinusoidal row).
`left_align` converts right- (or any other) padding.

The cache holds P + max_new_tokens - 1 slots, allocated once (a local layer's,
one of ModelConfig.attention_pattern's "local" kind: a ring of its window;
model/kv_cache.py); a step attends over all of them (masked), so the cost per
step is constant over a generation and the whole decode loop is one
`lax.while_loop` with the cache donated. A cache larger than the device's free
memory is refused before compiling, naming the largest max_new_tokens that fits
(`check_cache_memory`).

Layers run unrolled while decoding (`decode_config`: scan_layers=False; the
stacked weights of a scanned model are sliced per layer inside the jit). A
scanned stack carries the cache as scan input and output, which rewrites the
whole cache every step: at config M, batch 8, that made a step 2.5x slower
at 255 cache slots than at 31; unrolled, each step writes only its slot.
Public functions take the model's own config and variables.

rope_scaling="dynamic_ntk" rescales by the largest position in each call (as
Hugging Face does with a cache), so past the original context a row's
continuation can depend on the longest row of its batch.
"""

from __future__ import annotations

import functools
import time
from typing import Any, NamedTuple, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np

from model import decode_memory  # noqa: F401  (tests patch decode.decode_memory)
from model.config import ModelConfig
from model.kv_cache import (cache_bytes, cache_shapes, check_cache_memory,  # noqa: F401
                            decode_config, init_cache, unstack_layers)
from model.transformer import Transformer

PAD = -1  # tokens_BT entry for "no token": after the row's EOS, or never reached.


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


# Prompts -----------------------------------------------------------------------


def pad_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, pad_to_multiple: int = 1
                ) -> tuple[np.ndarray, np.ndarray]:
  """Left-padded (tokens_BP int32, valid_BP bool).

  P is the longest prompt rounded up to a multiple of `pad_to_multiple`
  (bucketing prompt lengths saves recompiles across prompts).
  """
  if int(pad_to_multiple) != pad_to_multiple or pad_to_multiple < 1:
    raise ValueError(f"pad_to_multiple={pad_to_multiple!r}: must be an integer >= 1")
  if not prompts:
    raise ValueError("prompts: need at least one prompt")
  lengths = [len(p) for p in prompts]
  if min(lengths) == 0:
    raise ValueError(f"prompts[{lengths.index(0)}] is empty: every prompt needs a token "
                     "(e.g. a BOS token) to condition the first prediction on")
  P = -(-max(lengths) // pad_to_multiple) * pad_to_multiple
  tokens_BP = np.zeros((len(prompts), P), np.int32)
  valid_BP = np.zeros((len(prompts), P), bool)
  for b, p in enumerate(prompts):
    ids = np.asarray(p)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer) or (
        ids.min() < 0 or ids.max() >= vocab_size):
      raise ValueError(f"prompts[{b}]: token ids must be integers in [0, vocab_size="
                       f"{vocab_size})")
    tokens_BP[b, P - len(p):] = ids
    valid_BP[b, P - len(p):] = True
  return tokens_BP, valid_BP


def left_align(tokens_BP: jax.Array, valid_BP: jax.Array
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Any padding -> left padding: (tokens_BP, positions_BP, segment_ids_BP).

  Valid tokens keep their order (stable sort); positions count valid tokens
  only, so a row's positions are 0..n_b-1 whatever its padding was.
  """
  chex.assert_equal_shape([tokens_BP, valid_BP])
  order_BP = jnp.argsort(valid_BP.astype(jnp.int32), axis=1, stable=True)
  tokens_BP = jnp.take_along_axis(tokens_BP, order_BP, axis=1)
  segment_ids_BP = jnp.take_along_axis(valid_BP.astype(jnp.int32), order_BP, axis=1)
  positions_BP = jnp.maximum(jnp.cumsum(segment_ids_BP, axis=1) - 1, 0)
  return tokens_BP, positions_BP, segment_ids_BP


# Sampling ----------------------------------------------------------------------


def sample(logits_BV: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
  """Next token_B: argmax at temperature 0, else temperature + top-k + top-p.

  Sampling is argmax(logits / temperature + Gumbel noise) over the kept
  tokens (the Gumbel-max trick, as jax.random.categorical): one noise draw
  serves both the filtered and the plain branch.
  """
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


# The jitted pieces ---------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("cfg", "cache_len"))
def prefill(cfg: ModelConfig, variables: Any, tokens_BP: jax.Array, valid_BP: jax.Array,
            cache_len: int) -> tuple[Any, jax.Array, jax.Array]:
  """All prompts in one call -> (cache with index P, last logits_BV, next_pos_B)."""
  B, P = tokens_BP.shape
  if cache_len < P:
    raise ValueError(f"cache_len={cache_len} is shorter than the prompts ({P})")
  tokens_BP, positions_BP, segment_ids_BP = left_align(tokens_BP, valid_BP)
  variables = unstack_layers(cfg, variables)
  logits_BPV, mutated = Transformer(decode_config(cfg)).apply(
      {**variables, "cache": init_cache(cfg, B, cache_len)}, tokens_BP, positions_BP,
      segment_ids_BP, decode=True, mutable=["cache"])
  return mutated["cache"], logits_BPV[:, -1], jnp.sum(segment_ids_BP, axis=1)


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

  def emit(t, logits_BV, done_B, tokens_BT, logits_BTV):
    tok_B = sample(logits_BV, jax.random.fold_in(key, t), sampling)
    tokens_BT = tokens_BT.at[:, t].set(jnp.where(done_B, PAD, tok_B))
    if return_logits:
      logits_BTV = logits_BTV.at[:, t].set(logits_BV)
    return tok_B, done_B | (tok_B == eos_id), tokens_BT, logits_BTV

  def cond(state):
    t, done_B = state[0], state[4]
    return (t < T) & ~jnp.all(done_B)

  def body(state):
    t, cache, tok_B, pos_B, done_B, tokens_BT, logits_BTV = state
    logits_B1V, mutated = net.apply({**variables, "cache": cache}, tok_B[:, None],
                                    pos_B[:, None], segment_ids_B1, decode=True,
                                    mutable=["cache"])
    tok_B, done_B, tokens_BT, logits_BTV = emit(t, logits_B1V[:, 0], done_B, tokens_BT,
                                                logits_BTV)
    return t + 1, mutated["cache"], tok_B, pos_B + 1, done_B, tokens_BT, logits_BTV

  tokens_BT = jnp.full((B, T), PAD, jnp.int32)
  logits_BTV = jnp.zeros((B, T, V) if return_logits else (0,), jnp.float32)
  first = emit(0, logits_BV, jnp.zeros((B,), bool), tokens_BT, logits_BTV)
  _, cache, _, _, _, tokens_BT, logits_BTV = jax.lax.while_loop(
      cond, body, (jnp.int32(1), cache, first[0], next_pos_B, *first[1:]))
  out = {"tokens_BT": tokens_BT, "cache": cache}
  if return_logits:
    out["logits_BTV"] = logits_BTV
  return out


# The whole thing -----------------------------------------------------------------


def check_length(cfg: ModelConfig, prompt_len: int, max_new_tokens: int) -> None:
  """Learned positions have max_seq_len rows: fail before compiling, not with NaNs."""
  if int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens!r}: must be an integer >= 1")
  if cfg.pos_encoding == "learned" and prompt_len + max_new_tokens > cfg.max_seq_len:
    raise ValueError(
        f"prompt length {prompt_len} + max_new_tokens {max_new_tokens} exceeds "
        f"ModelConfig.max_seq_len={cfg.max_seq_len}, the size of the learned position "
        "table; shorten the prompt or lower max_new_tokens")


def generate_with_stats(cfg: ModelConfig, variables: Any,
                        prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                        temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                        seed: int = 0, eos_id: int | None = None, pad_to_multiple: int = 1
                        ) -> tuple[list[list[int]], dict[str, float]]:
  """`generate`, plus timings: compile_s, prefill_s, decode_s, new_tokens."""
  check_length(cfg, max(map(len, prompts), default=0), max_new_tokens)
  tokens_BP, valid_BP = pad_prompts(prompts, cfg.vocab_size, pad_to_multiple)
  P = tokens_BP.shape[1]
  check_cache_memory(cfg, len(prompts), P, max_new_tokens)
  sampling = Sampling.make(temperature, top_k, top_p)
  eos = jnp.int32(-1 if eos_id is None else eos_id)
  key = jax.random.key(seed)
  cache_len = P + max_new_tokens - 1

  t0 = time.perf_counter()  # Compile ahead (cached across calls) to time it apart.
  prefill_fn = prefill.lower(cfg, variables, tokens_BP, valid_BP, cache_len).compile()
  cache_spec = cache_shapes(cfg, len(prompts), cache_len)
  logits_spec = jax.ShapeDtypeStruct((len(prompts), cfg.vocab_size), jnp.float32)
  pos_spec = jax.ShapeDtypeStruct((len(prompts),), jnp.int32)
  decode_fn = decode.lower(cfg, variables, cache_spec, logits_spec, pos_spec, key, sampling,
                           eos, max_new_tokens=max_new_tokens).compile()
  t1 = time.perf_counter()
  cache, logits_BV, next_pos_B = jax.block_until_ready(
      prefill_fn(variables, tokens_BP, valid_BP))
  t2 = time.perf_counter()
  out = decode_fn(variables, cache, logits_BV, next_pos_B, key, sampling, eos)
  tokens_BT = np.asarray(out["tokens_BT"])
  t3 = time.perf_counter()

  results = []
  for row in tokens_BT.tolist():
    n = row.index(PAD) if PAD in row else len(row)
    row = row[:n]
    results.append(row[:row.index(eos_id)] if eos_id in row else row)
  stats = {"compile_s": t1 - t0, "prefill_s": t2 - t1, "decode_s": t3 - t2,
           "new_tokens": float(sum(len(r) for r in results))}
  return results, stats


def generate(model_cfg: ModelConfig, variables: Any, prompts: Sequence[Sequence[int]],
             max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, eos_id: int | None = None,
             pad_to_multiple: int = 1) -> list[list[int]]:
  """Continuations of `prompts` (lists of token ids), one list per prompt.

  Each continuation has at most max_new_tokens ids and stops before `eos_id`
  (the EOS itself is not included). temperature=0 is greedy; `variables` is
  what Transformer(model_cfg).apply takes ({"params": ..., maybe "moe_state"}).
  Prompts may differ in length (they are left-padded, see the module doc).
  """
  return generate_with_stats(model_cfg, variables, prompts, max_new_tokens,
                             temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                             eos_id=eos_id, pad_to_multiple=pad_to_multiple)[0]

"""Generation on the host: `generate` (the Python API) and `launch.py --mode generate`.

Pads the prompts, checks the request before compiling, runs model/decode/loop.py's
jitted `prefill` and `decode`, times them and trims each continuation at its
EOS. See model/decode/loop.py for the left-aligned batch and the cache.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from model.config import ModelConfig
from model.decode.loop import PAD, check_length, decode, prefill
from model.decode.cache import cache_shapes
from train.decode_memory import check_cache_memory
from model.decode.sampling import Sampling


def pad_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, pad_to_multiple: int = 1
                ) -> tuple[np.ndarray, np.ndarray]:
  """Left-padded (tokens_BL int32, valid_BL bool).

  L is the longest prompt rounded up to a multiple of `pad_to_multiple`
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
  L = -(-max(lengths) // pad_to_multiple) * pad_to_multiple
  tokens_BL = np.zeros((len(prompts), L), np.int32)
  valid_BL = np.zeros((len(prompts), L), bool)
  for b, p in enumerate(prompts):
    ids = np.asarray(p)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer) or (
        ids.min() < 0 or ids.max() >= vocab_size):
      raise ValueError(f"prompts[{b}]: token ids must be integers in [0, vocab_size="
                       f"{vocab_size})")
    tokens_BL[b, L - len(p):] = ids
    valid_BL[b, L - len(p):] = True
  return tokens_BL, valid_BL


def trim(tokens_BT: np.ndarray, eos_id: int | None) -> list[list[int]]:
  """Each row's ids up to its first PAD, and before its EOS."""
  results = []
  for row in tokens_BT.tolist():
    row = row[:row.index(PAD)] if PAD in row else row
    results.append(row[:row.index(eos_id)] if eos_id in row else row)
  return results


def generate_with_stats(cfg: ModelConfig, variables: Any,
                        prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                        temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                        seed: int = 0, eos_id: int | None = None, pad_to_multiple: int = 1
                        ) -> tuple[list[list[int]], dict[str, float]]:
  """`generate`, plus timings: compile_s, prefill_s, decode_s, new_tokens."""
  check_length(cfg, max(map(len, prompts), default=0), max_new_tokens)
  tokens_BL, valid_BL = pad_prompts(prompts, cfg.vocab_size, pad_to_multiple)
  B, L = tokens_BL.shape
  check_cache_memory(cfg, B, L, max_new_tokens)
  sampling = Sampling.make(temperature, top_k, top_p)
  eos = jnp.int32(-1 if eos_id is None else eos_id)
  key = jax.random.key(seed)
  cache_len = L + max_new_tokens - 1

  t0 = time.perf_counter()  # Compile ahead (cached across calls) to time it apart.
  prefill_fn = prefill.lower(cfg, variables, tokens_BL, valid_BL, cache_len).compile()
  cache_spec = cache_shapes(cfg, B, cache_len)
  logits_spec = jax.ShapeDtypeStruct((B, cfg.vocab_size), jnp.float32)
  pos_spec = jax.ShapeDtypeStruct((B,), jnp.int32)
  decode_fn = decode.lower(cfg, variables, cache_spec, logits_spec, pos_spec, key, sampling,
                           eos, max_new_tokens=max_new_tokens).compile()
  t1 = time.perf_counter()
  cache, logits_BV, next_pos_B = jax.block_until_ready(
      prefill_fn(variables, tokens_BL, valid_BL))
  t2 = time.perf_counter()
  out = decode_fn(variables, cache, logits_BV, next_pos_B, key, sampling, eos)
  tokens_BT = np.asarray(out["tokens_BT"])
  t3 = time.perf_counter()

  results = trim(tokens_BT, eos_id)
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
  Prompts may differ in length (they are left-padded, see model/decode/loop.py).
  """
  return generate_with_stats(model_cfg, variables, prompts, max_new_tokens,
                             temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                             eos_id=eos_id, pad_to_multiple=pad_to_multiple)[0]


def check_prompt(prompt: str) -> None:
  """Every tokenizer encodes UTF-8: refuse text that has none, naming the byte.

  Command-line bytes that are not UTF-8 reach sys.argv as lone surrogates
  (U+DC80..U+DCFF stand for the bytes 0x80..0xFF, PEP 383), which would fail
  deep inside the tokenizer with a UnicodeEncodeError.
  """
  try:
    prompt.encode("utf-8")
  except UnicodeEncodeError as e:
    char = prompt[e.start]
    offset = len(prompt[:e.start].encode("utf-8"))
    what = (f"byte 0x{ord(char) - 0xDC00:02x}" if 0xDC80 <= ord(char) <= 0xDCFF
            else f"lone surrogate {char!r}")
    raise ValueError(
        f"--prompt is not valid UTF-8: {what} at byte {offset} (character {e.start}, "
        f"after {prompt[max(0, e.start - 20):e.start]!r}); pass UTF-8 text (check the "
        "terminal's locale or the encoding of the file the prompt came from)") from None


def generate_main(workdir: str, prompt: str, max_new_tokens: int = 200,
                  temperature: float = 0.8, top_k: int = 0, top_p: float = 1.0,
                  seed: int = 0, step: int | None = None) -> str:
  """Prints prompt + continuation and the speed; returns the continuation's text.

  Sampling stops at the tokenizer's EOS (if it has one) or after
  max_new_tokens. The speed counts prefill + decode, not the compile.
  """
  # Here, not at the top: a cycle (train.lifecycle.load -> train.eval.mode ->
  # train.eval.tasks -> train.eval.harness -> train.generate).
  from train import load_run  # pylint: disable=g-import-not-at-top
  check_prompt(prompt)  # Before loading the run: a bad prompt fails in no time.
  run = load_run(workdir, step=step)
  ids = run.tokenizer.encode(prompt)
  if not ids:
    raise ValueError(f"prompt={prompt!r}: encodes to no tokens; give --prompt some text")
  (new_ids,), stats = generate_with_stats(
      run.model_config, run.variables, [ids], max_new_tokens, temperature=temperature,
      top_k=top_k, top_p=top_p, seed=seed, eos_id=run.tokenizer.eos_id)
  # Decode prompt and continuation together: a character may span the boundary.
  print(run.tokenizer.decode(ids + new_ids))
  seconds = stats["prefill_s"] + stats["decode_s"]
  print(f"{len(new_ids)} tokens in {seconds:.2f} s ({len(new_ids) / seconds:.1f} tokens/s); "
        f"compile {stats['compile_s']:.1f} s, step {run.step}")
  return run.tokenizer.decode(new_ids)

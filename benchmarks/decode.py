"""Decode speed of MHA vs GQA vs MQA at config M: `python -m benchmarks.decode [--quick]`.

For each layout, batch (1, 8) and number of generated tokens (16, 240) after a
16-token prompt: prefill time, per-token latency (one decode step of the whole
batch, averaged over the while_loop) and decode tokens/s (best of the timed
runs: other processes only add time), plus the KV cache bytes. The cache holds prompt + new tokens, and a step attends over all of
it, so step time differs between 16 and 240 only by that attention read.
Weights are random (speed does not depend on them); no early stop (no EOS).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from model import ModelConfig
from model import decode as dec
from model.decode.cache import cache_bytes
from model.decode.sampling import Sampling
from model.transformer import abstract_variables

CONFIG_M = dict(vocab_size=4096, d_model=512, num_layers=8, num_heads=8, mlp_dim=1408,
                ffn="swiglu", pos_encoding="rope", max_seq_len=512)
LAYOUTS = {"MHA": 8, "GQA": 2, "MQA": 1}  # -> num_kv_heads.
PROMPT_LEN = 16


def random_variables(cfg: ModelConfig, seed: int = 0):
  shapes = abstract_variables(cfg)
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda s: jnp.asarray(rng.normal(0.0, 0.02, s.shape).astype(s.dtype)), shapes)


def measure(cfg: ModelConfig, variables, batch: int, new_tokens: int, reps: int) -> dict:
  rng = np.random.default_rng(1)
  tokens_BP = rng.integers(0, cfg.vocab_size, (batch, PROMPT_LEN), dtype=np.int32)
  valid_BP = np.ones((batch, PROMPT_LEN), bool)
  cache_len = PROMPT_LEN + new_tokens - 1
  sampling, eos, key = Sampling.make(), jnp.int32(-1), jax.random.key(0)
  t0 = time.perf_counter()
  prefill = dec.prefill.lower(cfg, variables, tokens_BP, valid_BP, cache_len).compile()
  cache, logits_BV, pos_B = prefill(variables, tokens_BP, valid_BP)
  decode = dec.decode.lower(cfg, variables, cache, logits_BV, pos_B, key, sampling, eos,
                            max_new_tokens=new_tokens).compile()
  compile_s = time.perf_counter() - t0
  prefill_s, decode_s = [], []
  for _ in range(reps + 1):  # The first run warms up (allocations, thread pools).
    t0 = time.perf_counter()
    cache, logits_BV, pos_B = jax.block_until_ready(prefill(variables, tokens_BP, valid_BP))
    t1 = time.perf_counter()
    out = decode(variables, cache, logits_BV, pos_B, key, sampling, eos)
    jax.block_until_ready(out["tokens_BT"])
    t2 = time.perf_counter()
    prefill_s.append(t1 - t0)
    decode_s.append(t2 - t1)
  assert (np.asarray(out["tokens_BT"]) >= 0).all(), "decode stopped early"
  steps = new_tokens - 1  # Token 0 comes from the prefill logits.
  d = min(decode_s[1:])  # Best of reps: other processes only ever add time.
  return {"batch": batch, "new_tokens": new_tokens, "cache_len": cache_len,
          "prefill_ms": 1e3 * min(prefill_s[1:]),
          "step_ms": 1e3 * d / steps, "decode_tokens_per_s": batch * steps / d,
          "cache_bytes": cache_bytes(cfg, batch, cache_len), "compile_s": compile_s}


def run(quick: bool) -> dict:
  """{"benchmark", "device", "config", "prompt_len", "results": [one dict per point]}."""
  results = []
  for layout, kv_heads in LAYOUTS.items():
    cfg = ModelConfig(num_kv_heads=kv_heads, **CONFIG_M)
    variables = random_variables(cfg)
    for batch in (1, 8):
      for new_tokens in (16, 240):
        point = measure(cfg, variables, batch, new_tokens, reps=2 if quick else 5)
        results.append({"layout": layout, "num_kv_heads": kv_heads, **point})
        print(f"{layout} B={batch} new={new_tokens}: {point['step_ms']:.2f} ms/step, "
              f"{point['decode_tokens_per_s']:.0f} tok/s, cache "
              f"{point['cache_bytes'] / 2**20:.1f} MiB", flush=True)
  return {"benchmark": "decode", "device": jax.devices()[0].device_kind,
          "backend": jax.default_backend(), "config": CONFIG_M, "prompt_len": PROMPT_LEN,
          "quick": quick, "results": results}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="2 timed runs per point, not 5")
  parser.add_argument("--out", default=None, help="Also write the JSON here.")
  args = parser.parse_args()
  result = run(args.quick)
  text = json.dumps(result, indent=1)
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  main()

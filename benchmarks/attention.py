"""Attention implementations: a training step's temporary memory and time, per length.

The step is forward + backward (gradients w.r.t. the parameters and the input) of
one Attention layer (projections, RoPE, attention) at CPU size: d_model 128,
4 heads (MHA), batch 1, float32, causal, one document per sequence. Memory is the
compiled step's `memory_analysis().temp_size_in_bytes` (XLA's buffer assignment
after reuse: what the step holds beyond its arguments and outputs); time is the
median of round-robin calls (benchmarks/common.py), compile excluded. Each
length compares "xla" (the reference, float32 [B, K, G, L, S] scores) with
"blockwise" (model/attention/blockwise.py); model/attention/impls.py's BLOCKWISE_MIN_LEN, the
length from which "auto" picks blockwise on CPU, comes from this table. A block
sweep times blockwise at 256 / 128 / 64 blocks for 4, 16 and 64 score rows (batch x
heads), against the block model/attention/blockwise.py's auto_block picks.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp

from benchmarks import common
from benchmarks.common import Mode
from model import ModelConfig
from model.attention.gqa import Attention
from model.attention.blockwise import AUTO_BLOCKS, auto_block

IMPLS = ("xla", "blockwise")
LENGTHS = {"full": (512, 2048, 4096, 8192), "quick": (512, 2048, 4096), "smoke": (64,)}
# The reference's step at L = 8192 takes half a minute on 2 CPU cores: few repetitions.
REPS = {"full": Mode("attention", warmup=1, steps=3, curve_steps=0),
        "quick": Mode("attention", warmup=1, steps=2, curve_steps=0),
        "smoke": Mode("attention", warmup=0, steps=1, curve_steps=0)}
LAYER = dict(vocab_size=256, d_model=128, num_layers=1, num_heads=4, num_kv_heads=4,
             mlp_dim=256)
# The block sweep: (batch, heads) of 4, 16 and 64 score rows (64: the M benchmark's
# batch 8 x 2 KV heads x 4), at one length with several blocks per side.
BLOCK_SWEEP_ROWS = ((1, 4), (4, 4), (8, 8))
BLOCK_SWEEP_LEN = {"full": 1024, "quick": 1024, "smoke": 64}
# (name, op, threshold, length, ratio key): issue 15's targets, blockwise over xla.
TARGETS = (("attention_temp_blockwise_vs_xla_L4096", "<=", 0.25, 4096, "temp"),
           ("attention_time_blockwise_vs_xla_L2048", "<=", 1.0, 2048, "time"),
           ("attention_time_blockwise_vs_xla_L4096", "<=", 1.0, 4096, "time"),
           ("attention_time_blockwise_vs_xla_L8192", "<=", 1.0, 8192, "time"))


def compile_step(cfg: ModelConfig, L: int, batch: int = 1):
  """(compiled fwd+bwd of one Attention layer, its arguments)."""
  layer = Attention(cfg)
  x_BLD = jax.random.normal(jax.random.key(0), (batch, L, cfg.d_model))
  pos_BL = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (batch, L))
  seg_BL = jnp.ones((batch, L), jnp.int32)
  params = nn.unbox(layer.init(jax.random.key(1), x_BLD[:, :8], pos_BL[:, :8],
                               seg_BL[:, :8])["params"])

  def loss(p, x):
    return jnp.mean(layer.apply({"params": p}, x, pos_BL, seg_BL) ** 2)

  t0 = time.perf_counter()
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x_BLD).compile()
  return compiled, (params, x_BLD), time.perf_counter() - t0


def run(mode: Mode) -> dict:
  """{"layer", "lengths", "results": [{L, impl, temp_bytes, step_ms, ...}], "ratios", "targets"}."""
  lengths, reps = LENGTHS[mode.name], REPS[mode.name]
  results, ratios = [], []
  for L in lengths:
    steps, row = {}, {}
    for impl in IMPLS:
      cfg = ModelConfig(**LAYER, max_seq_len=L, attention_impl=impl)
      compiled, args, compile_s = compile_step(cfg, L)
      steps[impl] = lambda c=compiled, a=args: jax.block_until_ready(c(*a))
      row[impl] = {"L": L, "impl": impl, "compile_s": compile_s,
                   "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes)}
    times = common.interleaved_times(steps, reps)
    for impl in IMPLS:
      r = row[impl]
      r.update(step_ms=1e3 * statistics.median(times[impl]), min_ms=1e3 * min(times[impl]),
               max_ms=1e3 * max(times[impl]))
      results.append(r)
      print(f"attention L={L} {impl}: step {r['step_ms']:.1f} ms, temporaries "
            f"{r['temp_bytes'] / 2**20:.1f} MiB", flush=True)
    x, b = row["xla"], row["blockwise"]
    ratios.append({"L": L, "temp": b["temp_bytes"] / x["temp_bytes"],
                   "time": b["step_ms"] / x["step_ms"]})
  out = {"layer": {**LAYER, "batch": 1, "dtype": "float32",
                   # What blocks 0 ("auto") resolve to for this layer's B * K * G rows.
                   "block_q": cfg.attention_block_q or auto_block(LAYER["num_heads"]),
                   "block_kv": cfg.attention_block_kv or auto_block(LAYER["num_heads"])},
         "lengths": list(lengths), "reps": dataclasses.asdict(reps), "results": results,
         "ratios": ratios}
  out["blocks"] = block_sweep(mode)
  out["targets"] = targets(out)
  return out


def block_sweep(mode: Mode) -> dict:
  """Blockwise step time per block length, for score tiles of 4 to 64 rows (B * K * G):
  the evidence behind model/attention/blockwise.py's auto_block, and whether it still holds."""
  L = BLOCK_SWEEP_LEN[mode.name]
  out = []
  for batch, heads in BLOCK_SWEEP_ROWS:
    steps = {}
    for block in AUTO_BLOCKS:
      cfg = ModelConfig(**{**LAYER, "num_heads": heads, "num_kv_heads": heads,
                           "head_dim": LAYER["d_model"] // LAYER["num_heads"]},
                        max_seq_len=L, attention_impl="blockwise", attention_block_q=block,
                        attention_block_kv=block)
      compiled, args, _ = compile_step(cfg, L, batch)
      steps[block] = lambda c=compiled, a=args: jax.block_until_ready(c(*a))
    times = common.interleaved_times(steps, REPS[mode.name])
    ms = {block: 1e3 * statistics.median(t) for block, t in times.items()}
    rows = batch * heads
    out.append({"batch": batch, "heads": heads, "rows": rows, "L": L,
                "step_ms": {str(b): v for b, v in ms.items()}, "auto": auto_block(rows),
                "auto_vs_best": ms[auto_block(rows)] / min(ms.values())})
    print(f"attention blocks, batch {batch} x {heads} heads, L={L}: "
          + ", ".join(f"{b}: {v:.1f} ms" for b, v in ms.items())
          + f" (auto {auto_block(rows)})", flush=True)
  return {"L": L, "results": out}


def targets(attention: dict) -> list[dict]:
  """The section's targets, in the fields of benchmarks/targets.py (unmeasured: not met)."""
  by_len = {r["L"]: r for r in attention.get("ratios", [])}
  out = []
  for name, op, threshold, L, key in TARGETS:
    value = by_len[L][key] if L in by_len else None
    met = value is not None and (value <= threshold if op == "<=" else value >= threshold)
    out.append({"name": name, "value": value, "threshold": threshold, "op": op, "met": met,
                "what": f"blockwise over xla {key} of an attention-layer train step, L={L}"})
  sweep = attention.get("blocks", {}).get("results")
  value = max(r["auto_vs_best"] for r in sweep) if sweep else None
  out.append({"name": "attention_auto_block_vs_best", "value": value, "threshold": 1.1,
              "op": "<=", "met": value is not None and value <= 1.1,
              "what": "blockwise step with auto_block's blocks over the fastest of 256 / 128 "
                      "/ 64, worst over 4-64 score rows"})
  return out


def block_table(attention: dict) -> list[str]:
  """Markdown lines: the block sweep, one row per (batch, heads)."""
  sweep = attention.get("blocks")
  if not sweep:
    return []
  lines = ["| batch x heads (rows) | L | " + " | ".join(f"{b} ms" for b in AUTO_BLOCKS)
           + " | auto | auto / best |", "|---" * (len(AUTO_BLOCKS) + 4) + "|"]
  for r in sweep["results"]:
    lines.append(f"| {r['batch']} x {r['heads']} ({r['rows']}) | {r['L']} | "
                 + " | ".join(f"{r['step_ms'][str(b)]:.1f}" for b in AUTO_BLOCKS)
                 + f" | {r['auto']} | {r['auto_vs_best']:.2f} |")
  return lines


def table(attention: dict) -> list[str]:
  """Markdown lines: one row per length, both implementations side by side."""
  rows = {}
  for r in attention["results"]:
    rows.setdefault(r["L"], {})[r["impl"]] = r
  lines = ["| L | xla temp MiB | blockwise temp MiB | temp ratio | xla step ms | "
           "blockwise step ms | time ratio |", "|---|---|---|---|---|---|---|"]
  for L, by_impl in rows.items():
    x, b = by_impl["xla"], by_impl["blockwise"]
    lines.append(f"| {L} | {x['temp_bytes'] / 2**20:.1f} | {b['temp_bytes'] / 2**20:.1f} | "
                 f"{b['temp_bytes'] / x['temp_bytes']:.3f} | {x['step_ms']:.0f} | "
                 f"{b['step_ms']:.0f} | {b['step_ms'] / x['step_ms']:.2f} |")
  return lines

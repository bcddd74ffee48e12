"""Context parallelism: attention memory per device against mesh.context, and step time.

    python -m benchmarks.context_parallel [--mode quick|full|smoke] --out FILE.json

1. Attention temporaries per device: the ring attention forward + backward (value and
   gradients of q, k, v) at L = 16384, compiled on a mesh of `context` = 1, 2, 4, 8
   simulated CPU devices (context = 1: one device, the same math without a ring);
   `temp_size_in_bytes` of the compiled executable's memory analysis, which is per
   device. q, k, v are given as the network holds them: in the zig-zag token order that
   model/transformer.py sets once per forward pass (parallel/context.py). Target: it
   falls as 1 / context within 20% (temp(1) / temp(c) >= 0.8 c). The block sizes the
   ring picked are reported with each figure.
2. Train-step time at context 8 against one device (config S at L = 2048, batch 1),
   interleaved. The 8 simulated devices share the host's cores, so this is a figure
   only: it says what the ring's extra work and collectives cost, not a speed-up.

The 8 CPU devices are set up here (XLA_FLAGS) before JAX starts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (after XLA_FLAGS)
import jax.numpy as jnp  # noqa: E402

from benchmarks import common  # noqa: E402
from model.attention.reference import AttnData, AttnSpec  # noqa: E402
from model.attention.ring import ring_attention, ring_block  # noqa: E402
from parallel import logical_rules, make_mesh, mesh_context  # noqa: E402
from parallel.context import to_zigzag_layout  # noqa: E402

CONTEXTS = (1, 2, 4, 8)
MEMORY_SHAPE = dict(B=1, L=16384, K=2, G=4, H=64)  # GQA: 8 query heads, 2 KV heads.
STEP_LEN = 2048
P = jax.sharding.PartitionSpec


def _mesh(context: int):
  """A mesh of `context` devices on the context axis (None for one device)."""
  if context == 1:
    return None
  return make_mesh({"context": context}, devices=jax.devices()[:context])


def attention_temporaries(context: int, shape: dict) -> dict:
  """Compiled memory of ring attention forward + backward on `context` devices."""
  B, L, K, G, H = (shape[k] for k in "BLKGH")
  f32 = jnp.float32
  args = (jax.ShapeDtypeStruct((B, L, K, G, H), f32), jax.ShapeDtypeStruct((B, L, K, H), f32),
          jax.ShapeDtypeStruct((B, L, K, H), f32))
  spec = AttnSpec(scale=H ** -0.5)

  def loss(q, k, v):  # q, k, v as the network holds them: in the zig-zag token order.
    ids = jnp.ones((B, L), jnp.int32)
    pos = to_zigzag_layout(jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L)))
    return jnp.sum(ring_attention(q, k, v, AttnData(ids, ids, pos, pos), spec))

  fn = jax.value_and_grad(loss, argnums=(0, 1, 2))
  mesh = _mesh(context)
  if mesh is None:
    compiled = jax.jit(fn).lower(*args).compile()
  else:
    sharding = jax.sharding.NamedSharding(mesh, P(None, "context"))
    with mesh_context(mesh, logical_rules(mesh=mesh)):
      compiled = jax.jit(fn, in_shardings=(sharding,) * 3).lower(*args).compile()
  stats = compiled.memory_analysis()
  block = ring_block(spec, L // (2 * context), B * K * G, H)
  return {"context": context, "temp_bytes": int(stats.temp_size_in_bytes), "block": block,
          "argument_bytes": int(stats.argument_size_in_bytes),
          "output_bytes": int(stats.output_size_in_bytes)}


def step_times(mode: common.Mode, length: int) -> dict:
  """Median train-step seconds of config S at `length`, batch 1: one device, context 8."""
  cfg = common.model_config("S", mode, max_seq_len=length, attention_impl="ring")
  batch = common.random_batch(cfg, batch=1)
  fns = {}
  for context in (1, 8):
    mesh = _mesh(context)
    rules = logical_rules(mesh=mesh) if mesh is not None else None
    step = common.compile_train_step(cfg, batch, mesh=mesh, rules=rules)
    fns[f"context{context}"] = common.stepper(step, batch)
  times = common.interleaved_times(fns, mode)
  return {name: statistics.median(t) for name, t in times.items()}


def run(mode: common.Mode) -> dict:
  shape = dict(MEMORY_SHAPE, L=1024) if mode.smoke else MEMORY_SHAPE
  memory = [attention_temporaries(c, shape) for c in CONTEXTS]
  base, ring2 = memory[0]["temp_bytes"], memory[1]["temp_bytes"]
  for m in memory:
    m["reduction"] = base / m["temp_bytes"]  # Target: >= 0.8 * context.
    m["meets_1_over_context_within_20pct"] = m["reduction"] >= 0.8 * m["context"]
    # Between ring sizes (the ring's own buffers present on both sides): ideal c / 2.
    m["reduction_vs_context2"] = ring2 / m["temp_bytes"]
    print(f"context={m['context']}: attention temporaries {m['temp_bytes'] / 2**20:.1f} MiB "
          f"per device ({m['reduction']:.2f}x less than one device; target >= "
          f"{0.8 * m['context']:.1f}x; blocks {m['block']})", flush=True)
  length = 256 if mode.smoke else STEP_LEN
  times = step_times(mode, length)
  ratio = times["context8"] / times["context1"]
  print(f"train step S, L={length}, batch 1: one device {times['context1']:.3f} s, "
        f"context=8 (simulated, shared cores) {times['context8']:.3f} s ({ratio:.2f}x)",
        flush=True)
  return {"memory_shape": shape, "memory": memory, "step_len": length,
          "step_seconds": times, "step_ratio_context8_over_1": ratio,
          "device": common.device_info()}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--mode", default="quick", choices=sorted(common.MODES))
  parser.add_argument("--out", default="", help="write the results as JSON here")
  args = parser.parse_args()
  jax.config.update("jax_enable_compilation_cache", False)
  results = run(common.MODES[args.mode])
  if args.out:
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()

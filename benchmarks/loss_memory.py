"""The loss alone on a TPU topology: the full-logits cross-entropy vs the vocabulary-tiled
one (train/loss.py), compiled on this host with libtpu, compared by compiled temporaries.

    python -m benchmarks.loss_memory [--preset 1b] [--topology v5e-16] [--per_chip 8]
        [--chunks auto] [--out loss_memory.json]

What is compiled is value_and_grad of the mean cross-entropy with respect to the head's
parameters and the hidden states: the head (`Embedder.decode`, the preset's tied or
untied table), the softmax and their backward, at the preset's vocabulary, width and
sequence length, `per_chip` sequences per chip, the mesh `fsdp` = all chips (as
experiments/configs/pod.py shards it), bfloat16 compute. The bound (issue 36): the tiled
loss's temporaries are >= 10x below the full logits'. Needs libtpu (`.[aot]`).
"""

from __future__ import annotations

import argparse
import json
import re
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from experiments.configs.pod import PRESETS
from model import ModelConfig
from model.transformer import abstract_variables
from parallel import (batch_sharding, logical_rules, logical_to_mesh_sharding, make_mesh,
                      mesh_context)
from train.aot.report import memory
from train.aot.topology import parse_topology, topology_devices
from train.loss import head_logits, resolve_chunks, token_losses

GiB = 1024 ** 3


def compile_loss(model_cfg, devices, batch: int, tiled: bool) -> dict:
  """value_and_grad of the mean loss (tiled: model_cfg.loss_chunks chunks; else the full
  logits) at `batch` sequences over an fsdp mesh of `devices`: memory and compile time."""


  mesh = make_mesh({"fsdp": -1}, devices)
  rules = logical_rules(mesh=mesh)
  boxed = {"embedder": abstract_variables(model_cfg, unbox=False)["params"]["embedder"]}
  shardings = logical_to_mesh_sharding(boxed, mesh, rules)
  params = jax.tree.map(lambda t, s: jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=s),
                        nn.unbox(boxed), shardings)
  L, D = model_cfg.max_seq_len, model_cfg.d_model
  rows = batch_sharding(mesh, rules)
  hidden_spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*rows.spec, None))
  hidden = jax.ShapeDtypeStruct((batch, L, D), jnp.dtype(model_cfg.dtype), sharding=hidden_spec)
  targets = jax.ShapeDtypeStruct((batch, L), jnp.int32, sharding=rows)

  def loss(p, h_BLD, t_BL):
    if tiled:
      return jnp.mean(token_losses(model_cfg, p, h_BLD, t_BL).ce_BL)
    logits_BLV = nn.with_logical_constraint(head_logits(model_cfg, p, h_BLD),
                                            ("batch", "length", "vocab"))
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits_BLV, t_BL))

  with mesh_context(mesh, rules):
    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    t0 = time.perf_counter()
    try:
      compiled = fn.lower(params, hidden, targets).compile()
    except jax.errors.JaxRuntimeError as e:  # XLA:TPU refuses over-HBM programs: its figure.
      m = re.search(r"HLO temporaries \(([\d.]+)G\)", str(e))
      if not m:
        raise
      return {"temporaries": int(float(m.group(1)) * GiB), "arguments": 0,
              "out_of_memory": True, "compile_s": round(time.perf_counter() - t0, 1)}
    seconds = time.perf_counter() - t0
  return {**memory(compiled), "compile_s": round(seconds, 1)}


def compare(cfg, topology: str, per_chip: int) -> dict:
  """The full-logits loss and the tiled one (cfg.loss_chunks) compiled for `topology` at
  `per_chip` sequences of cfg.max_seq_len per chip: their memory and the ratio."""
  topo = parse_topology(topology)
  devices = topology_devices(topo)
  batch = per_chip * topo.num_chips
  chunks = resolve_chunks(cfg, batch, cfg.max_seq_len, {"fsdp": topo.num_chips})
  full = compile_loss(cfg, devices, batch, tiled=False)
  tiled = compile_loss(cfg, devices, batch, tiled=True)
  ratio = full["temporaries"] / max(tiled["temporaries"], 1)
  return {"topology": topo.name, "per_chip": per_chip, "seq_len": cfg.max_seq_len,
          "vocab_size": cfg.vocab_size, "chunks": chunks, "full_logits": full,
          "tiled": tiled, "temporaries_ratio": round(ratio, 1), "bound_10x": ratio >= 10}


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--preset", default="1b")
  p.add_argument("--topology", default="v5e-16")
  p.add_argument("--per_chip", type=int, default=8, help="sequences per chip")
  p.add_argument("--chunks", default="auto", help="model.loss_chunks of the tiled loss")
  p.add_argument("--out", default="")
  a = p.parse_args(argv)


  cfg = ModelConfig(**PRESETS[a.preset], dtype="bfloat16", loss_chunks=a.chunks)
  out = {"preset": a.preset, **compare(cfg, a.topology, a.per_chip)}
  topo, chunks, ratio = parse_topology(a.topology), out["chunks"], out["temporaries_ratio"]
  for name in ("full_logits", "tiled"):
    r = out[name]
    print(f"{name:12s} temporaries {r['temporaries'] / GiB:7.2f} GiB  arguments "
          f"{r['arguments'] / GiB:5.2f} GiB  compiled in {r['compile_s']} s")
  print(f"{a.preset} on {topo.name}, {a.per_chip} x {cfg.max_seq_len} per chip, vocab "
        f"{cfg.vocab_size}, {chunks} chunks: {ratio:.1f}x fewer temporaries "
        f"({'meets' if ratio >= 10 else 'MISSES'} the 10x bound)")
  if a.out:
    with open(a.out, "w") as f:
      json.dump(out, f, indent=1)
  return out


if __name__ == "__main__":
  main()

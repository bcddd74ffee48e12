"""The train step's compiled TPU memory under each remat policy (model/remat.py), on this
host with libtpu: device HBM (arguments + temporaries, memory_analysis) and the host
memory an offloading policy moves off the chip.

    python -m benchmarks.remat_memory [--topology v5e:2x2] [--per_chip 4] [--seq_len 1024]
        [--layers 4] [--policies none,full,...] [--out remat_memory.json]

The model: experiments/configs/pod.py preset=1b's structure (GQA, tied embeddings, SwiGLU,
bfloat16 compute, "auto" attention: Splash on TPU) at a small size (d_model 256, 4 heads,
2 KV heads, mlp 1024, vocab 512), data parallel over the chips, so each policy's saved
tensors are what moves the figure. tests/aot/test_remat_tpu.py asserts the orderings that
must hold on the same model; docs/model.md, "Remat policies", has the measured table.
"""

from __future__ import annotations

import argparse
import json
import time

from experiments.configs import pod
from model.remat import NAMES
from train.aot import compile_for_topology
from train.aot.topology import parse_topology

MiB = 2 ** 20
SMALL = dict(d_model=256, num_heads=4, num_kv_heads=2, mlp_dim=1024, vocab_size=512)


def small_config(policy: str, per_chip: int, seq_len: int, layers: int, chips: int,
                 custom: str = "", **model):
  """The benchmark's (and the aot test's) experiment config under `policy`."""
  c = pod.get_config("preset=1b,smoke")
  c.model.update(**{**SMALL, **model}, num_layers=layers, max_seq_len=seq_len, remat=policy,
                 remat_custom=custom)
  c.data.seq_len = seq_len
  c.data.batch_size = c.eval.batch_size = per_chip * chips
  c.mesh.update(data=chips, fsdp=1)
  return c


def measure(config, topology: str) -> dict:
  """One train-step compile: device and host memory per chip, and its compile time."""
  t0 = time.perf_counter()
  r = compile_for_topology(config, topology, steps=("train",), try_remat=False,
                           roofline=False)
  m = r["steps"]["train"]["memory"]
  return {"remat": config.model.remat, "device": m["arguments"] + m["temporaries"],
          "arguments": m["arguments"], "temporaries": m["temporaries"],
          "host": m.get("host_temporaries", 0), "total": m["total"],
          "compile_s": round(time.perf_counter() - t0, 1)}


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--topology", default="v5e:2x2")
  p.add_argument("--per_chip", type=int, default=4, help="sequences per chip")
  p.add_argument("--seq_len", type=int, default=1024)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--policies", default=",".join(n for n in NAMES if n != "custom"))
  p.add_argument("--out", default="")
  a = p.parse_args(argv)
  chips = parse_topology(a.topology).num_chips
  rows = []
  for policy in a.policies.split(","):
    row = measure(small_config(policy, a.per_chip, a.seq_len, a.layers, chips), a.topology)
    rows.append(row)
    print(f"remat={policy:<22} device {row['device'] / MiB:8.1f} MiB (temporaries "
          f"{row['temporaries'] / MiB:7.1f})  host {row['host'] / MiB:6.1f} MiB  "
          f"compiled in {row['compile_s']} s", flush=True)
  out = {"topology": a.topology, "per_chip": a.per_chip, "seq_len": a.seq_len,
         "layers": a.layers, "model": SMALL, "policies": rows}
  if a.out:
    with open(a.out, "w") as f:
      json.dump(out, f, indent=1)
  return out


if __name__ == "__main__":
  main()

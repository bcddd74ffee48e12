"""The first checkpoint save of a process on XLA:CPU: orbax's replica-parallel saving
(a `lax.slice` per replicated array and device, each compiled) against one device per
replicated array (train/checkpoint.py, what the trainer does on CPU).

  python -m benchmarks.checkpoint_save --out checkpoint_save.json

The smoke model's TrainState (experiments/configs/tiny.py:smoke), replicated over 8
simulated CPU devices at -O0, as the tests run it; each setting in a fresh process
(first and second save timed), persistent compilation cache off.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import flax.linen as nn
import jax
import numpy as np
import orbax.checkpoint as ocp

from experiments.configs import tiny
from train import checkpoint as ckpt
from train.optim import make_optimizer
from train.state import init_state
from train.spec import model_config

SETTINGS = ("replica_parallel", "one_device")


def child(setting: str) -> dict:

  c = tiny.get_config("smoke")
  c.train.async_checkpoint = False
  optimizer = make_optimizer(c.train)
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  state = jax.jit(lambda: nn.unbox(init_state(model_config(c), optimizer, 0, 32)),
                  out_shardings=replicated)()
  out = {"setting": setting, "devices": jax.device_count(),
         "arrays": len(jax.tree.leaves(state))}
  with tempfile.TemporaryDirectory() as d:
    for i in range(2):
      manager = ckpt.make_manager(os.path.join(d, str(i)), c.train)
      if setting == "replica_parallel":  # orbax's own CPU default, as before.
        ocp.type_handlers.register_type_handler(jax.Array, ocp.type_handlers.ArrayHandler(),
                                                override=True)
      t0 = time.perf_counter()
      ckpt.save(manager, 1, state, None, force=True)
      manager.wait_until_finished()
      out[("first" if i == 0 else "second") + "_save_s"] = time.perf_counter() - t0
      manager.close()
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="")
  parser.add_argument("--child", choices=SETTINGS, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    print(json.dumps(child(args.child)))
    return
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_ENABLE_COMPILATION_CACHE": "false",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=8"
                      " --xla_backend_optimization_level=0"}
  results = []
  for setting in SETTINGS:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.checkpoint_save", "--child",
                           setting], env=env, capture_output=True, text=True, check=True)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    results.append(r)
    print(f"{setting}: first save {r['first_save_s']:.2f} s, second {r['second_save_s']:.2f} s"
          f" ({r['arrays']} arrays over {r['devices']} devices)", flush=True)
  out = {"load_average": os.getloadavg(), "results": results}
  if args.out:
    with open(args.out, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()

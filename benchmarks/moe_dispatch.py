"""MoE-S step time per dispatch path, against the dense config with equal active parameters.

The dense twin is S: MoE-S routes each token to 2 experts of hidden 512, the same
2 * 512 = 1024 FFN width S has (plus the router's D x E matmul).

  capacity         capacity buffers, factor 1.25: moe_dispatch="auto", which one device
                   runs as capacity_gather (row gathers into [E, B, C, D] buffers)
  dropless         sort by expert + blocked grouped matmul (model/moe/grouped.py), never drops
  default          ModelConfig's defaults: "auto", factor 0 (never drops), which one
                   device runs as dropless (model/moe/dispatch.py)
  expert_parallel  capacity einsums with experts over an 8-way "expert" mesh axis
                   (all_to_all), 8 simulated CPU devices

The expert-parallel figures come from a subprocess (`python -m benchmarks.moe_dispatch
--expert-parallel`) started with XLA_FLAGS=--xla_force_host_platform_device_count=8,
so every other figure of the run is measured on one device; its dense twin is
measured in that subprocess on the same mesh (the batch split over the 8 devices).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

from benchmarks import common
from benchmarks.common import Mode
from model import ModelConfig
from parallel import logical_rules, make_mesh

# Row name -> moe_dispatch (the names of the targets and of docs/PERFORMANCE.md's runs).
# "default": MoE-S as ModelConfig leaves it (moe_dispatch="auto", capacity_factor
# 0 = never drop), which a single device runs through the sorted grouped computation.
DISPATCH = {"capacity": "auto", "dropless": "dropless", "default": None}
LOCAL = tuple(DISPATCH)
EP_DEVICES = 8
MARK = "MOE_EP_JSON "


def _stepper(cfg, mesh=None, rules=None):
  batch = common.random_batch(cfg)
  return common.stepper(common.compile_train_step(cfg, batch, mesh=mesh, rules=rules), batch)


def _moe_config(path: str, mode: Mode):
  if path == "default":
    default = ModelConfig.__dataclass_fields__
    return common.model_config("MoE-S", mode, moe_dispatch=default["moe_dispatch"].default,
                               capacity_factor=default["capacity_factor"].default)
  return common.model_config("MoE-S", mode, moe_dispatch=DISPATCH[path])


def _medians_ms(fns: dict, mode: Mode) -> dict[str, float]:
  return {k: 1e3 * statistics.median(v) for k, v in common.interleaved_times(fns, mode).items()}


def _row(path: str, moe_ms: float, dense_ms: float, devices: int) -> dict:
  row = {"dispatch": path, "devices": devices, "step_ms": moe_ms, "dense_step_ms": dense_ms,
         "ratio_vs_dense": moe_ms / dense_ms}
  print(f"moe-S {path} ({devices} device(s)): {moe_ms:.0f} ms vs dense {dense_ms:.0f} ms "
        f"= {row['ratio_vs_dense']:.2f}x", flush=True)
  return row


def expert_parallel(mode: Mode) -> dict:
  """In a process with EP_DEVICES devices: dense S and MoE-S EP on an expert mesh."""
  import jax  # pylint: disable=g-import-not-at-top
  if jax.device_count() != EP_DEVICES:
    raise ValueError(f"expert-parallel benchmark needs {EP_DEVICES} devices, found "
                     f"{jax.device_count()}: set XLA_FLAGS=--xla_force_host_platform_"
                     f"device_count={EP_DEVICES}")
  mesh = make_mesh({"expert": EP_DEVICES})
  dense = common.model_config("S", mode)
  moe = common.model_config("MoE-S", mode, moe_dispatch="expert_parallel")
  fns = {}
  for name, cfg in (("dense", dense), ("moe", moe)):
    rules = logical_rules(mesh=mesh, num_kv_heads=cfg.num_kv_heads, num_heads=cfg.num_heads)
    fns[name] = _stepper(cfg, mesh, rules)
  ms = _medians_ms(fns, mode)
  return _row("expert_parallel", ms["moe"], ms["dense"], EP_DEVICES)


def run_expert_parallel_subprocess(mode: Mode, timeout_s: float = 3600) -> dict:
  env = dict(os.environ)
  flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", env.get("XLA_FLAGS", ""))
  env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={EP_DEVICES}".strip()
  env.setdefault("JAX_PLATFORMS", "cpu")
  env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
  cmd = [sys.executable, "-m", "benchmarks.moe_dispatch", "--expert-parallel",
         "--mode", mode.name]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True,
                        timeout=timeout_s, check=False)
  lines = proc.stdout.splitlines()
  for line in lines:
    if not line.startswith(MARK):
      print(line, flush=True)
  lines = [l for l in lines if l.startswith(MARK)]
  if proc.returncode or not lines:
    raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n"
                       f"{proc.stderr[-4000:]}")
  return json.loads(lines[-1][len(MARK):])


def run(mode: Mode) -> dict:
  """{"dense_config": "S", "results": [one row per dispatch path]}."""
  fns = {"dense": _stepper(common.model_config("S", mode))}
  for path in LOCAL:
    fns[path] = _stepper(_moe_config(path, mode))
  ms = _medians_ms(fns, mode)
  rows = [_row(path, ms[path], ms["dense"], 1) for path in LOCAL]
  rows.append(run_expert_parallel_subprocess(mode))
  return {"dense_config": "S", "moe_config": "MoE-S",
          "capacity_factors": dict(common.CAPACITY_FACTOR), "results": rows}


def ratio(moe_result: dict, path: str) -> float:
  for r in moe_result["results"]:
    if r["dispatch"] == path:
      return r["ratio_vs_dense"]
  raise KeyError(f"no MoE result for dispatch {path!r}")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--expert-parallel", action="store_true", required=True,
                      help="measure the expert-parallel path (needs 8 devices)")
  parser.add_argument("--mode", choices=sorted(common.MODES), default="quick")
  args = parser.parse_args(argv)
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_enable_compilation_cache", False)
  print(MARK + json.dumps(expert_parallel(common.MODES[args.mode])), flush=True)


if __name__ == "__main__":
  main()

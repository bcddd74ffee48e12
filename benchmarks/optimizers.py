"""What each train.optimizer costs on CPU (issue 49 item 3): optimizer-state bytes per
parameter and the train step's time against AdamW's, at config S, float32, one device.

State bytes are the state's arrays as trained (counters and placeholders included), over
the parameter count. Steps run round-robin across the optimizers, each timed in wall
seconds and in this process's CPU seconds (the work a step does, steadier than wall time
on a shared machine: docs/PERFORMANCE.md, "Stability telemetry"); the medians and their
ratios to AdamW are reported. Muon's Newton-Schulz FLOPs are in its step time, not in any
MFU (docs/training.md, "Optimizers").
"""

from __future__ import annotations

import time

import jax
import numpy as np

from benchmarks import common
from benchmarks.common import Mode
from train.optimizers import OPTIMIZERS


def _size(tree) -> tuple[int, int]:
  """(elements, bytes) of a pytree's arrays."""
  leaves = jax.tree.leaves(tree)
  return sum(int(x.size) for x in leaves), sum(int(x.nbytes) for x in leaves)


def run(mode: Mode) -> dict:
  """{"config", "params", "results": {optimizer: {state_bytes_per_param, compile_s,
  step_s, step_vs_adamw, step_cpu_s, cpu_vs_adamw}}}."""
  cfg = common.model_config("S", mode)
  batch = common.random_batch(cfg)
  results, steppers, params = {}, {}, 0
  for name in OPTIMIZERS:
    t = common.train_config()
    t.optimizer = name
    if name == "schedule_free_adamw":
      t.schedule = "constant"  # Its only schedule (train/spec/checks.py).
    step = common.compile_train_step(cfg, batch, t_cfg=t)
    params = _size(step.state.params)[0]
    results[name] = {"state_bytes_per_param": _size(step.state.opt_state)[1] / params,
                     "compile_s": step.lower_s + step.compile_s}
    steppers[name] = common.stepper(step, batch)
  wall, cpu = {k: [] for k in steppers}, {k: [] for k in steppers}
  for i in range(mode.warmup + mode.steps):
    for name, fn in steppers.items():
      t0, c0 = time.perf_counter(), time.process_time()
      fn()
      if i >= mode.warmup:
        wall[name].append(time.perf_counter() - t0)
        cpu[name].append(time.process_time() - c0)
  med = lambda xs: float(np.median(xs))
  for name in steppers:
    r = results[name]
    r.update(step_s=med(wall[name]), step_vs_adamw=med(wall[name]) / med(wall["adamw"]),
             step_cpu_s=med(cpu[name]), cpu_vs_adamw=med(cpu[name]) / med(cpu["adamw"]))
    print(f"optimizer {name}: state {r['state_bytes_per_param']:.2f} B/param, step "
          f"{r['step_s'] * 1e3:.0f} ms wall ({r['step_vs_adamw']:.2f}x adamw), "
          f"{r['step_cpu_s'] * 1e3:.0f} ms CPU ({r['cpu_vs_adamw']:.2f}x)", flush=True)
  return {"config": "S", "dtype": "float32", "params": params, "results": results}

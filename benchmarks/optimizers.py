"""What each train.optimizer costs on CPU (issue 49 item 3): optimizer-state bytes per
parameter and the train step's time against AdamW's, at config S, float32, one device.

State bytes are the state's arrays as trained (counters and placeholders included), over
the parameter count. Step times are interleaved round-robin across the optimizers
(common.interleaved_times), so their ratios to AdamW hold on a busy machine; Muon's
Newton-Schulz FLOPs are in its step time, not in any MFU (docs/training.md, "Optimizers").
"""

from __future__ import annotations

import numpy as np

from benchmarks import common
from benchmarks.common import Mode
from train.optimizers import OPTIMIZERS


def _size(tree) -> tuple[int, int]:
  """(elements, bytes) of a pytree's arrays."""
  import jax  # pylint: disable=g-import-not-at-top
  leaves = jax.tree.leaves(tree)
  return sum(int(x.size) for x in leaves), sum(int(x.nbytes) for x in leaves)


def run(mode: Mode) -> dict:
  """{"config", "params", "results": {optimizer: {state_bytes_per_param, step_s,
  step_vs_adamw, compile_s}}}."""
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
  times = common.interleaved_times(steppers, mode)
  base = float(np.median(times["adamw"]))
  for name, ts in times.items():
    results[name].update(step_s=float(np.median(ts)), step_vs_adamw=float(np.median(ts)) / base)
    r = results[name]
    print(f"optimizer {name}: state {r['state_bytes_per_param']:.2f} B/param, step "
          f"{r['step_s'] * 1e3:.0f} ms ({r['step_vs_adamw']:.2f}x adamw)", flush=True)
  return {"config": "S", "dtype": "float32", "params": params, "results": results}

"""The step-time cost of train.telemetry (train/telemetry.py): the project's train step
at config S, telemetry on vs off, timed interleaved (benchmarks/common.py), on CPU.

    python -m benchmarks.telemetry [--steps 30] [--quick | --smoke] [--out telemetry.json]

The bound (issue 39): the step with telemetry is at most 5% slower than without. Both
steps are compiled ahead of time from the same state and batch; the figure is the ratio
of the medians of `steps` interleaved timed steps (a burst of other load slows both).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

BOUND = 0.05


def measure(mode_name: str, steps: int | None) -> dict:
  import dataclasses  # pylint: disable=g-import-not-at-top
  from benchmarks import common  # pylint: disable=g-import-not-at-top
  mode = common.MODES[mode_name]
  if steps:
    mode = dataclasses.replace(mode, steps=steps)
  cfg = common.model_config("S", mode)
  batch = common.random_batch(cfg)
  fns, compile_s = {}, {}
  for on in (True, False):
    t_cfg = common.train_config()
    t_cfg.telemetry = on
    step = common.compile_train_step(cfg, batch, t_cfg=t_cfg)
    name = "telemetry_on" if on else "telemetry_off"
    fns[name], compile_s[name] = common.stepper(step, batch), step.compile_s
  start = common.cpu_snapshot()
  times = common.interleaved_times(fns, mode)
  med = {k: statistics.median(v) for k, v in times.items()}
  overhead = med["telemetry_on"] / med["telemetry_off"] - 1
  return {"benchmark": "telemetry", "config": "S", "mode": mode.name, "batch": common.BATCH,
          "seq_len": cfg.max_seq_len, "timed_steps": mode.steps,
          "median_step_s": med, "step_s": times, "compile_s": compile_s,
          "overhead": overhead, "bound": BOUND, "within_bound": overhead <= BOUND,
          "others_cores": common.others_cores(start), "device": common.device_info(),
          "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=None, help="timed steps (default: the mode's)")
  p.add_argument("--quick", action="store_true")
  p.add_argument("--smoke", action="store_true", help="tiny shapes: checks the harness only")
  p.add_argument("--out", default="telemetry.json")
  a = p.parse_args(argv)
  result = measure("smoke" if a.smoke else "quick" if a.quick else "full", a.steps)
  with open(a.out, "w") as f:
    json.dump(result, f, indent=2)
  print(f"telemetry overhead at S: {100 * result['overhead']:+.1f}% (bound "
        f"{100 * BOUND:.0f}%: {'met' if result['within_bound'] else 'MISSED'}); "
        f"median step {result['median_step_s']}; wrote {a.out}")
  return result


if __name__ == "__main__":
  main()

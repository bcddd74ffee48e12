"""The step-time cost of train.telemetry (train/telemetry.py): the project's train step
at config S, telemetry on vs off, timed interleaved (benchmarks/common.py), on CPU.

    python -m benchmarks.telemetry [--steps 30] [--quick | --smoke] [--out telemetry.json]

The bound (issue 39): the step with telemetry is at most 5% slower than without. Both
steps are compiled ahead of time from the same state and batch and timed interleaved;
`overhead` is the ratio of the medians of the steps' process CPU seconds (the work a
step does: on a shared 2-core machine, wall times swing by tens of percent from one
step to the next), `wall_overhead` the same for wall seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

BOUND = 0.05


def _interleaved(fns: dict, mode) -> tuple[dict, dict]:
  """Wall and process CPU seconds (all of this process's threads) of each step, the
  variants interleaved: on a shared machine the CPU time is the work a step does, which
  other load barely moves; the wall time is what a user waits, which it does."""
  wall, cpu = {k: [] for k in fns}, {k: [] for k in fns}
  for i in range(mode.warmup + mode.steps):
    for name, fn in fns.items():
      t0, c0 = time.perf_counter(), time.process_time()
      fn()
      if i >= mode.warmup:
        wall[name].append(time.perf_counter() - t0)
        cpu[name].append(time.process_time() - c0)
  return wall, cpu


def measure(mode_name: str, steps: int | None) -> dict:
  import dataclasses  # pylint: disable=g-import-not-at-top
  # Here: benchmarks.common imports jax; `--help` and the import stay light.
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
  times, cpu = _interleaved(fns, mode)
  med = {k: statistics.median(v) for k, v in times.items()}
  cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
  overhead = cpu_med["telemetry_on"] / cpu_med["telemetry_off"] - 1
  return {"benchmark": "telemetry", "config": "S", "mode": mode.name, "batch": common.BATCH,
          "seq_len": cfg.max_seq_len, "timed_steps": mode.steps,
          "median_step_s": med, "median_step_cpu_s": cpu_med, "step_s": times,
          "step_cpu_s": cpu, "compile_s": compile_s,
          "wall_overhead": med["telemetry_on"] / med["telemetry_off"] - 1,
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
  print(f"telemetry overhead at S: {100 * result['overhead']:+.1f}% CPU time per step "
        f"(bound {100 * BOUND:.0f}%: {'met' if result['within_bound'] else 'MISSED'}), "
        f"{100 * result['wall_overhead']:+.1f}% wall; median step CPU "
        f"{result['median_step_cpu_s']}, wall {result['median_step_s']}; wrote {a.out}")
  return result


if __name__ == "__main__":
  main()

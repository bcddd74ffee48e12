"""Every performance figure of the project, with its references, in one run.

    python -m benchmarks.run [--quick] --out FILE.json

Prints tables and writes JSON: the device and its measured matmul peak (the
roofline), training throughput and MFU (this project in float32 and bfloat16, HF
transformers in float32), bf16 vs f32 loss curves, MoE dispatch paths against the
dense twin, compile time, train-step memory, decode speed, attention implementations (their own
targets in results["attention"]["targets"]), optimizer state and step costs, and a `targets` list
(name, value, threshold, op, met). Each reference is measured in the same run, so
the ratios hold on a busy machine even when the absolute figures do not.

A section that fails is recorded under "errors" and its targets are not met; the
others still run. `--sections` runs a subset (their targets only are meaningful).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback

# Light (no jax): jax is imported in _setup_jax, after JAX_PLATFORMS is set.
from train.hostenv import reexec_with_malloc_tuning

SECTIONS = ("roofline", "train", "curves", "moe", "compile", "memory", "decode", "attention",
            "optimizers", "quantization")


def _setup_jax(measuring: bool = True) -> None:
  # A single device for everything but the expert-parallel subprocess; no persistent
  # compilation cache, so compile times are compiles and not cache reads. Smoke mode
  # measures nothing: it keeps the process's cache (the test suite's), so the programs
  # it shares with other tests, or with its own last run, are compiled once.
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax  # pylint: disable=g-import-not-at-top
  if measuring:
    jax.config.update("jax_enable_compilation_cache", False)
  jax.config.update("jax_threefry_partitionable", True)


def run(mode_name: str = "quick", sections: tuple[str, ...] = SECTIONS) -> dict:
  """Runs the chosen sections; returns the results dict (with "targets")."""
  _setup_jax(measuring=mode_name != "smoke")
  # After _setup_jax: JAX_PLATFORMS and the cache flag are set before jax loads.
  from benchmarks import (attention, common, compile_time, decode_compare, memory,  # pylint: disable=g-import-not-at-top
                          moe_dispatch, optimizers, quantization, roofline, targets,
                          train_speed)
  if mode_name not in common.MODES:
    raise ValueError(f"mode={mode_name!r}: must be one of {sorted(common.MODES)}")
  unknown = sorted(set(sections) - set(SECTIONS))
  if unknown:
    raise ValueError(f"sections {unknown}: unknown; known: {list(SECTIONS)}")
  mode = common.MODES[mode_name]
  t_start, cpu_start = time.time(), common.cpu_snapshot()
  results = {"schema_version": 1, "mode": mode.name,
             "started": datetime.datetime.now().isoformat(timespec="seconds"),
             "device": common.device_info(), "configs": common.CONFIGS,
             "batch": common.BATCH, "sections": list(sections), "errors": {},
             "section_seconds": {}}
  if "roofline" not in sections:
    sections = ("roofline",) + tuple(sections)  # Every MFU needs it.
  work = {
      "roofline": lambda: roofline.run(mode),
      "train": lambda: train_speed.run(mode, results["roofline"]),
      "curves": lambda: train_speed.loss_curves(mode),
      "moe": lambda: moe_dispatch.run(mode),
      "compile": lambda: compile_time.run(mode),
      "memory": lambda: memory.run(mode),
      "decode": lambda: decode_compare.run(mode),
      "attention": lambda: attention.run(mode),
      "optimizers": lambda: optimizers.run(mode),
      "quantization": lambda: quantization.run(mode),
  }
  todo = [name for name in SECTIONS if name in sections]
  for i, name in enumerate(todo, 1):
    t0 = time.time()
    print(f"== {name} (section {i}/{len(todo)}, {t0 - t_start:.0f} s so far)", flush=True)
    try:
      value = work[name]()
    except Exception:  # pylint: disable=broad-except
      results["errors"][name] = traceback.format_exc()
      print(results["errors"][name], file=sys.stderr, flush=True)
      value = None
    results["section_seconds"][name] = time.time() - t0
    if value is None:
      continue
    if name == "curves":
      results.setdefault("train", {})["loss_curves"] = value
    elif name == "train":
      results.setdefault("train", {}).update(value)
    else:
      results[name] = value
  results["duration_s"] = time.time() - t_start
  results["device"]["load_avg_1min_at_end"] = os.getloadavg()[0]
  # What the busy-machine warning reads: others' CPU use, not this run's own threads.
  results["device"]["other_processes_cores"] = common.others_cores(cpu_start)
  results["targets"] = targets.build(results)
  return results


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="few timed steps and short loss curves (minutes, noisier)")
  parser.add_argument("--smoke", action="store_true",
                      help="tiny configs, one step: checks the harness, measures nothing")
  parser.add_argument("--out", default=None, help="write the JSON results here")
  parser.add_argument("--sections", default=",".join(SECTIONS),
                      help=f"comma-separated subset of {','.join(SECTIONS)}")
  args = parser.parse_args(argv)
  mode = "smoke" if args.smoke else "quick" if args.quick else "full"
  sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
  results = run(mode, sections)
  # After _setup_jax, as the sections above (table imports them).
  from benchmarks import table  # pylint: disable=g-import-not-at-top
  print(table.format_results(results), flush=True)
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)
      f.write("\n")
    print(f"wrote {args.out} ({results['duration_s']:.0f} s)", flush=True)
  return 1 if results["errors"] else 0


if __name__ == "__main__":
  reexec_with_malloc_tuning()  # As launch.py: the steps timed are the steps users run.
  sys.exit(main())

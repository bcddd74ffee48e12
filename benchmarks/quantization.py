"""What model.quantization costs on CPU (issue 48 item 5): the train step's time at
config S, one device, each quantization against the unquantized step of the same
compute dtype (float32 and bfloat16).

On XLA:CPU a quantized dot buys nothing known in advance: whether its int8 x int8 ->
int32 dot or its fp8 operands run any faster than bfloat16 is what this measures, beside
the work quantization adds (each dot's scale reductions, rounding and casts of both
operands, forward and backward). The speed-up is a TPU claim (docs/compile.md, the pod
table's int8 column). Steps run round-robin across the variants, timed in wall and in
this process's CPU seconds (steadier on a shared machine); medians and ratios reported.
"""

from __future__ import annotations

import time

import numpy as np

from benchmarks import common
from benchmarks.common import Mode

# (compute dtype, quantization): each against (its dtype, "none").
VARIANTS = (("float32", "none"), ("float32", "int8"), ("bfloat16", "none"),
            ("bfloat16", "int8"), ("bfloat16", "fp8"), ("bfloat16", "int8_weight"))


def run(mode: Mode) -> dict:
  """{"config", "results": {"<dtype>/<quantization>": {compile_s, step_s, step_cpu_s,
  vs_none, cpu_vs_none}}}."""
  results, steppers = {}, {}
  for dtype, quant in VARIANTS:
    cfg = common.model_config("S", mode, dtype=dtype, quantization=quant)
    batch = common.random_batch(cfg)
    step = common.compile_train_step(cfg, batch)
    key = f"{dtype}/{quant}"
    results[key] = {"compile_s": step.lower_s + step.compile_s}
    steppers[key] = common.stepper(step, batch)
  wall, cpu = {k: [] for k in steppers}, {k: [] for k in steppers}
  for i in range(mode.warmup + mode.steps):
    for key, fn in steppers.items():
      t0, c0 = time.perf_counter(), time.process_time()
      fn()
      if i >= mode.warmup:
        wall[key].append(time.perf_counter() - t0)
        cpu[key].append(time.process_time() - c0)
  med = lambda xs: float(np.median(xs))
  for key in steppers:
    base = key.split("/")[0] + "/none"
    r = results[key]
    r.update(step_s=med(wall[key]), step_cpu_s=med(cpu[key]),
             vs_none=med(wall[key]) / med(wall[base]), cpu_vs_none=med(cpu[key]) / med(cpu[base]))
    print(f"quantization {key}: step {r['step_s'] * 1e3:.0f} ms wall ({r['vs_none']:.2f}x "
          f"unquantized), {r['step_cpu_s'] * 1e3:.0f} ms CPU ({r['cpu_vs_none']:.2f}x)",
          flush=True)
  return {"config": "S", "results": results}

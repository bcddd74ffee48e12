"""bfloat16 training MFU of a ~1B model on one GPU, against the GPU's measured bf16
matmul peak (benchmarks/gpu_check.sh runs it; it needs an accelerator).

    python -m benchmarks.gpu_mfu --out gpu_mfu.json [--batch 8] [--steps 10]

The model is experiments/configs/pod.py's `1b` preset (Llama 3.2 1B shape) at sequence
2048; the step is the project's own (benchmarks/common.py compile_train_step: the
train_step the trainer runs, one device). MFU = model FLOPs (model/flops.py) per second
over the best of several 8192^3 bf16 matmuls on the same device.
"""

from __future__ import annotations

import argparse
import json
import time

import jax

from benchmarks.common import compile_train_step, device_info, random_batch, stepper
from experiments.configs import pod
from model.flops import training_flops_per_token
from train.peak import measure_peak_flops
from train.spec import model_config


def run(batch: int, steps: int, seq_len: int = 2048, preset: str = "1b",
        peak_sizes=(4096, 8192)) -> dict:
  config = pod.get_config(f"preset={preset}")
  config.model.max_seq_len = seq_len
  # The preset's pod recipe (1b: remat=full) is for a pod's HBM; this measures the step
  # without recomputation, as its published figures did.
  config.model.update(remat="none", remat_custom="")
  cfg = model_config(config)
  peak = max(measure_peak_flops("bfloat16", n, 5) for n in peak_sizes)
  step = compile_train_step(cfg, random_batch(cfg, batch))
  one = stepper(step, random_batch(cfg, batch))
  one()  # Warm-up.
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    one()
    times.append(time.perf_counter() - t0)
  best = min(times)
  tokens_per_s = batch * seq_len / best
  flops = training_flops_per_token(cfg, seq_len) * tokens_per_s
  return {"device": device_info(), "model": f"pod.py:preset={preset}", "seq_len": seq_len,
          "batch": batch, "compile_s": step.compile_s, "step_times_s": times,
          "tokens_per_s": tokens_per_s, "model_flops_per_s": flops,
          "matmul_peak_bf16": peak, "mfu_vs_measured_peak": flops / peak,
          "attention_impl": cfg.attention_impl, "backend": jax.default_backend()}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default="gpu_mfu.json")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--seq_len", type=int, default=2048)
  p.add_argument("--preset", default="1b", help="pod.py preset (125m: a CPU dry run)")
  a = p.parse_args()
  r = run(a.batch, a.steps, a.seq_len, a.preset, (4096, 8192) if a.preset == "1b" else (512,))
  print(f"{r['device']['device_kind']}: {r['tokens_per_s']:.0f} tokens/s, "
        f"{r['model_flops_per_s'] / 1e12:.1f} TFLOP/s of {r['matmul_peak_bf16'] / 1e12:.1f} "
        f"measured peak: MFU {r['mfu_vs_measured_peak']:.1%}")
  with open(a.out, "w") as f:
    json.dump(r, f, indent=1)


if __name__ == "__main__":
  main()

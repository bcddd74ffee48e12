"""Quantization ablation: model.quantization none / int8 / fp8 times attention MHA / GQA /
MQA (num_kv_heads N, N/2, 1), times seeds. Does low-precision training cost one
attention layout more than another? The report's interaction.md answers with CIs: each
layout's Δ(quantized - none), paired by seed, and the difference of those Δs to MHA's.

  python launch.py --config experiments/configs/quant_ablation.py:cpu --workdir runs/quant --sweep
  python -m experiments.report runs/quant        # -> runs/quant/report/interaction.md

arg (comma-separated):
  size=tiny|small|medium   model preset (base.py); N = its num_heads
  seeds=3                  training seeds 0..seeds-1 per point
  schemes=none+int8+fp8    the quantizations ("+"-separated; none is the baseline, first)
  cpu                      the CPU preset (base.apply_cpu: d_model 64, 2 layers, 800 steps
                           of 16 x 64 tokens) in bfloat16 compute, as the pods train
  steps=N                  train.steps (0: the preset's)
  smoke                    seconds-long runs (tests, CI)
"""

from experiments import sweep as sweep_lib
from experiments.configs import base
from model.quantization import QUANTIZATIONS


def _arg(arg):
  return base.parse_arg(arg, **base.ARGS, seeds=3, schemes="none+int8+fp8", cpu=False,
                        steps=0)


def schemes(a) -> list[str]:
  names = a.schemes.split("+")
  bad = [n for n in names if n not in QUANTIZATIONS]
  if bad or not names or names[0] != "none":
    raise ValueError(f"schemes={a.schemes!r}: '+'-separated names of {QUANTIZATIONS}, "
                     "starting with none (the baseline)")
  return names


def get_config(arg: str | None = None):
  a = _arg(arg)
  schemes(a)
  c = base.get_config(a)
  c.name = "quant_ablation"
  if a.cpu:
    base.apply_cpu(c, a)
  c.model.dtype = "bfloat16"
  if a.steps:
    c.train.steps = a.steps
    c.train.warmup_steps = min(c.train.warmup_steps, a.steps)
  return c


def kv_heads(num_heads: int) -> list[int]:
  """MHA, GQA (N/2 KV heads, or MHA's N where N is odd) and MQA; no repeats."""
  return list(dict.fromkeys([num_heads, max(1, num_heads // 2), 1]))


def sweep(arg: str | None = None) -> list[dict]:
  a, c = _arg(arg), get_config(arg)
  return [{"name": f"{q}-kv{k}-s{s}", "model.quantization": q, "model.num_kv_heads": k,
           "train.seed": s}
          for k in kv_heads(c.model.num_heads) for q in schemes(a)
          for s in sweep_lib.seeds(a.seeds)]

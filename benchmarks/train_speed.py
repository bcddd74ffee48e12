"""Training throughput and MFU of this project's train step, and the bf16-vs-f32 loss curves.

    MFU = tokens/s * training_flops_per_token(cfg, L) / num_devices / matmul peak

with model/flops.py's count and `mfu` (see docs/PERFORMANCE.md), num_devices = 1
(every step here runs on the default device) and the one-device matmul peak timed
round-robin with the steps (benchmarks/roofline.py). The step is train/step.py's,
jitted with the state donated, exactly what train/loop.py runs; its median excludes
compilation.
"""

from __future__ import annotations

import statistics

import jax
import numpy as np

from benchmarks import common, roofline
from benchmarks.common import Mode
from experiments.configs import base
from model.flops import matmul_params_per_token, mfu, training_flops_per_token
from train.data.pipeline import make_source

DTYPES = ("float32", "bfloat16")
CURVE_CONFIG = "S"  # Loss curves at S: byte-level Shakespeare fits its 256-token vocab.
CURVE_BLOCK = 20  # Steps per block when comparing the curves.


def figures(cfg, step_times: list[float], dtype: str) -> dict:
  """Median step and tokens/s; `add_mfu` adds MFU once the run's peak is known."""
  step_s = statistics.median(step_times)
  L = cfg.max_seq_len
  return {"dtype": dtype, "step_ms": 1e3 * step_s, "tokens_per_s": common.BATCH * L / step_s,
          "step_ms_min_max": [1e3 * min(step_times), 1e3 * max(step_times)],
          "flops_per_token": training_flops_per_token(cfg, L),
          "matmul_params": matmul_params_per_token(cfg)}


def add_mfu(r: dict, peaks: dict, num_devices: int = 1) -> dict:
  """MFU against the compute dtype's peak and against the float32 peak (both per device);
  compile_train_step without a mesh runs on one device, hence num_devices=1."""
  tps, fpt = r["tokens_per_s"], r["flops_per_token"]
  return {**r, "mfu": mfu(tps, fpt, peaks[r["dtype"]], num_devices),
          "mfu_vs_f32_peak": mfu(tps, fpt, peaks["float32"], num_devices)}


def best_peak(roofline_peaks: dict, probe_rates: dict[str, list[float]]) -> dict[str, float]:
  """Per dtype, the best matmul rate seen anywhere in the run: the roofline's start
  (including PyTorch's float32 GEMM, the reference's own peak) and every probe.

  A peak timed under load (a probe beside the steps) is not a peak: dividing by it
  once gave "127% MFU". With the best rate of the run, MFU <= 1 holds whenever
  the model's FLOP/s are below the best matmul's, which they must be."""
  out = {}
  for dt in DTYPES:
    seen = [roofline_peaks[dt], *probe_rates.get(dt, [])]
    if dt == "float32" and roofline_peaks.get("torch_float32"):
      seen.append(roofline_peaks["torch_float32"])
    out[dt] = max(seen)
  return out


def run(mode: Mode, peaks: dict, reference: bool = True) -> dict:
  """{"project": {config: {dtype: figures}}, "reference": {config: figures}, "peak": ...}.

  S, M and MoE-S; this project in float32 and bfloat16, HF in float32. Per config the
  step functions and two matmul probes are timed round-robin (common.interleaved_times).
  Every MFU divides by `peak`: the best of `peaks` (roofline.run) and every probe.
  """
  out = {"project": {}, "reference": {}}
  rates = {dt: [] for dt in DTYPES}
  for name in ("S", "M", "MoE-S"):
    fns, cfgs, compile_s, probes = {}, {}, {}, {}
    for dtype in DTYPES:
      cfgs[dtype] = cfg = common.model_config(name, mode, dtype=dtype)
      batch = common.random_batch(cfg)
      step = common.compile_train_step(cfg, batch)
      fns[dtype], compile_s[dtype] = common.stepper(step, batch), step.compile_s
      probes[dtype] = fns[f"peak_{dtype}"] = roofline.Probe(
          dtype, n=256 if mode.smoke else roofline.CONTENDER_SIZE)
    if reference:
      # Optional dependency: the PyTorch reference (the interop extra).
      from benchmarks import reference_hf  # pylint: disable=g-import-not-at-top
      fns["reference"], ref_info = reference_hf.train_stepper(cfgs["float32"])
    times = common.interleaved_times(fns, mode)
    for dtype in DTYPES:
      rates[dtype] += probes[dtype].rates
      out["project"].setdefault(name, {})[dtype] = {
          **figures(cfgs[dtype], times[dtype], dtype), "compile_s": compile_s[dtype]}
    if reference:
      out["reference"][name] = {**ref_info, **figures(cfgs["float32"], times["reference"],
                                                      "float32")}
  out["peak"] = peak = best_peak(peaks, rates)
  for name, by_dtype in out["project"].items():
    for dtype, r in by_dtype.items():
      by_dtype[dtype] = r = add_mfu(r, peak)
      print(f"train {name} {dtype}: {r['step_ms']:.0f} ms/step, {r['tokens_per_s']:,.0f} "
            f"tok/s, MFU {100 * r['mfu']:.1f}% (of f32 peak: {100 * r['mfu_vs_f32_peak']:.1f}%)",
            flush=True)
    if name in out["reference"]:
      out["reference"][name] = r = add_mfu(out["reference"][name], peak)
      print(f"reference {r['arch']} {name} float32: {r['step_ms']:.0f} ms/step, "
            f"{r['tokens_per_s']:,.0f} tok/s, MFU {100 * r['mfu']:.1f}%", flush=True)
  print("matmul peak for MFU: " + ", ".join(f"{dt} {p / 1e9:.1f} GFLOP/s"
                                             for dt, p in peak.items()), flush=True)
  return out


def _batches(cfg, steps: int, mode: Mode) -> list[dict]:
  """`steps` batches of byte-level Shakespeare (random tokens in smoke mode)."""
  if mode.smoke:
    return [common.random_batch(cfg, seed=i) for i in range(steps)]
  d = base.get_config().data
  source = make_source(d, None)
  if source.tokenizer.vocab_size > cfg.vocab_size:
    raise ValueError(f"loss curves: tokenizer vocab {source.tokenizer.vocab_size} exceeds "
                     f"ModelConfig.vocab_size={cfg.vocab_size}")
  it = source.train_iterator(0, common.BATCH, cfg.max_seq_len)
  return [next(it) for _ in range(steps)]


def _curve(cfg, batches: list[dict]) -> list[float]:
  step = common.compile_train_step(cfg, batches[0], steps=len(batches))
  state, losses = step.state, []
  for b in batches:
    state, metrics = step.fn(state, jax.device_put(b))
    losses.append(float(metrics["loss"]))
  return losses


def loss_curves(mode: Mode) -> dict:
  """float32 and bfloat16 loss curves from the same init and data, and their gap.

  `max_block_gap`: the largest relative difference between the two curves' means
  over blocks of CURVE_BLOCK steps (per-step losses are too noisy to compare one by
  one); `final_gap`: the same over the last block.
  """
  steps = mode.curve_steps
  base_cfg = common.model_config(CURVE_CONFIG, mode)
  batches = _batches(base_cfg, steps, mode)
  curves = {dt: _curve(base_cfg.replace(dtype=dt), batches) for dt in ("float32", "bfloat16")}
  block = min(CURVE_BLOCK, steps)
  gaps = []
  for start in range(0, steps - block + 1, block):
    f32 = np.mean(curves["float32"][start:start + block])
    bf16 = np.mean(curves["bfloat16"][start:start + block])
    gaps.append(float(abs(bf16 - f32) / f32))
  out = {"config": CURVE_CONFIG, "steps": steps, "block": block,
         "data": "random tokens (smoke)" if mode.smoke else "shakespeare, byte tokenizer",
         "max_block_gap": max(gaps), "final_gap": gaps[-1], "block_gaps": gaps, **curves}
  print(f"loss curves ({steps} steps): f32 {curves['float32'][0]:.3f} -> "
        f"{curves['float32'][-1]:.3f}, bf16 {curves['bfloat16'][0]:.3f} -> "
        f"{curves['bfloat16'][-1]:.3f}, max block gap {100 * max(gaps):.2f}%", flush=True)
  return out

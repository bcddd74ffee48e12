"""The printed (markdown) tables of one run's results; docs/PERFORMANCE.md pastes them."""

from __future__ import annotations

from typing import Any


def _fmt(x: Any, spec: str = ".3g") -> str:
  return "-" if x is None else format(x, spec)


def _rows(header: list[str], rows: list[list[str]]) -> list[str]:
  out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  return out + ["| " + " | ".join(r) + " |" for r in rows]


def train_table(train: dict) -> list[str]:
  rows = []
  for name, by_dtype in train.get("project", {}).items():
    for dtype, r in by_dtype.items():
      rows.append([name, "blockwork", dtype, f"{r['step_ms']:.0f}", f"{r['tokens_per_s']:,.0f}",
                   f"{100 * r['mfu_vs_f32_peak']:.1f}%", f"{100 * r['mfu']:.1f}%"])
    ref = train.get("reference", {}).get(name)
    if ref:
      rows.append([name, f"HF {ref['arch']}", "float32", f"{ref['step_ms']:.0f}",
                   f"{ref['tokens_per_s']:,.0f}", f"{100 * ref['mfu']:.1f}%",
                   f"{100 * ref['mfu']:.1f}%"])
  return _rows(["config", "impl", "compute", "step ms", "tokens/s", "MFU (f32 peak)",
                "MFU (own-dtype peak)"], rows)


def section_tables(results: dict) -> list[str]:
  out = []
  if "roofline" in results and "float32" in results["roofline"]:
    r = results["roofline"]
    torch_peak = r.get("torch_float32")
    out += ["", f"Matmul peak (best of repeats, start of run): float32 {r['float32'] / 1e9:.1f} "
                f"GFLOP/s, bfloat16 (f32 accumulation) {r['bfloat16'] / 1e9:.1f} GFLOP/s" +
            (f"; PyTorch float32 {torch_peak / 1e9:.1f} GFLOP/s" if torch_peak else ""), ""]
  if "train" in results and "project" in results["train"]:
    out += ["Training (median step after warm-up, compile excluded)", ""]
    out += train_table(results["train"])
    peak = results["train"].get("peak")
    if peak:
      out += ["", "MFU divides by the best matmul peak of the run (start, and probes between "
              f"the steps): float32 {peak['float32'] / 1e9:.1f}, bfloat16 "
              f"{peak['bfloat16'] / 1e9:.1f} GFLOP/s"]
  curves = results.get("train", {}).get("loss_curves")
  if curves:
    out += ["", f"Loss curves at {curves['config']} over {curves['steps']} steps "
                f"({curves['data']}): float32 {curves['float32'][-1]:.3f}, bfloat16 "
                f"{curves['bfloat16'][-1]:.3f} at the end; largest block gap "
                f"{100 * curves['max_block_gap']:.2f}%"]
  if "moe" in results and "results" in results["moe"]:
    out += ["", "MoE-S step vs dense S (equal active parameters)", ""]
    out += _rows(["dispatch", "devices", "MoE ms", "dense ms", "ratio"],
                 [[r["dispatch"], str(r["devices"]), f"{r['step_ms']:.0f}",
                   f"{r['dense_step_ms']:.0f}", f"{r['ratio_vs_dense']:.2f}"]
                  for r in results["moe"]["results"]])
  if "compile" in results and "results" in results["compile"]:
    out += ["", "Train-step compile time (config S width)", ""]
    out += _rows(["layers", "scan", "lower s", "compile s", "total s"],
                 [[str(r["layers"]), str(r["scan"]), f"{r['lower_s']:.1f}",
                   f"{r['compile_s']:.1f}", f"{r['total_s']:.1f}"]
                  for r in results["compile"]["results"]])
  if "memory" in results and "results" in results["memory"]:
    out += ["", "Train-step memory at M, float32 (compiled memory analysis)", ""]
    out += _rows(["remat", "peak MiB", "temporaries MiB", "arguments MiB"],
                 [[p, f"{m['peak_bytes'] / 2**20:.0f}", f"{m['temp_bytes'] / 2**20:.0f}",
                   f"{m['argument_bytes'] / 2**20:.0f}"]
                  for p, m in results["memory"]["results"].items()])
  if "optimizers" in results and "results" in results["optimizers"]:
    out += ["", "train.optimizer at S, float32: state and step time", ""]
    out += _rows(["optimizer", "state B/param", "wall ms", "x adamw", "CPU ms", "x adamw"],
                 [[n, f"{r['state_bytes_per_param']:.2f}", f"{r['step_s'] * 1e3:.0f}",
                   f"{r['step_vs_adamw']:.2f}", f"{r['step_cpu_s'] * 1e3:.0f}",
                   f"{r['cpu_vs_adamw']:.2f}"]
                  for n, r in results["optimizers"]["results"].items()])
  if "quantization" in results and "results" in results["quantization"]:
    out += ["", "model.quantization at S: train step time on this CPU, against unquantized",
            ""]
    out += _rows(["dtype/quantization", "wall ms", "x none", "CPU ms", "x none"],
                 [[k, f"{r['step_s'] * 1e3:.0f}", f"{r['vs_none']:.2f}",
                   f"{r['step_cpu_s'] * 1e3:.0f}", f"{r['cpu_vs_none']:.2f}"]
                  for k, r in results["quantization"]["results"].items()])
  if "decode" in results and "project" in results["decode"]:
    d = results["decode"]
    out += ["", "Decode at M (16-token prompt; latency = one step of the batch)", ""]
    rows = [[r["layout"], str(r["batch"]), str(r["new_tokens"]), f"{r['step_ms']:.2f}",
             f"{r['decode_tokens_per_s']:,.0f}", f"{r['cache_bytes'] / 2**20:.1f}"]
            for r in d["project"]["results"]]
    ref = d.get("reference")
    if ref:
      for p, ms in ref["latency_ms"].items():
        rows.append([f"HF {ref['arch']}", "1", p, f"{ms:.2f}",
                     f"{ref['decode_tokens_per_s']:,.0f}", "-"])
    out += _rows(["layout", "batch", "position", "ms/token", "tokens/s", "cache MiB"], rows)
  if "attention" in results and "results" in results["attention"]:
    # Here: attention imports jax; tabling other sections' JSON needs none.
    from benchmarks import attention  # pylint: disable=g-import-not-at-top
    a = results["attention"]
    out += ["", f"Attention layer train step (d_model {a['layer']['d_model']}, "
                f"{a['layer']['num_heads']} heads, batch 1, float32): xla vs blockwise", ""]
    out += attention.table(a) + [""]
    if a.get("blocks"):
      out += ["Blockwise block length by score rows (same layer, batch x heads as given)", ""]
      out += attention.block_table(a) + [""]
    out += targets_table(a["targets"])
  return out


def targets_table(targets: list[dict]) -> list[str]:
  return _rows(["target", "value", "threshold", "met"],
               [[t["name"], _fmt(t["value"]), f"{t['op']} {t['threshold']:g}",
                 "yes" if t["met"] else ("NOT MEASURED" if t["value"] is None else "no")]
                for t in targets])


BUSY = 0.5  # Cores per core used by other processes above which the machine is busy.


def busy_warning(device: dict) -> list[str]:
  """Other processes on the cores slow PyTorch's many small OpenMP ops far more
  than XLA's fused ones (each op's thread barrier waits for a descheduled thread).
  Measured as the cores other processes kept busy during the run (/proc/stat minus the
  run's own CPU time: `other_processes_cores`); a run without it (not Linux, older JSON)
  falls back to the load average, which counts the benchmark's own threads, and says so."""
  cores = device.get("cpu_count") or 1
  if device.get("backend") != "cpu":
    return []
  tail = ("absolute figures are low and ratios against PyTorch are distorted (its many "
          "small multi-threaded ops wait on descheduled threads); rerun on a quiet machine "
          "for figures to quote.")
  others = device.get("other_processes_cores")
  if others is not None:
    if others <= BUSY * cores:
      return []
    return [f"WARNING: busy machine (other processes kept {others:.1f} of {cores} cores busy "
            f"on average during the run, this benchmark's own CPU time excluded): {tail}", ""]
  loads = [device.get(k) for k in ("load_avg_1min_at_start", "load_avg_1min_at_end")]
  loads = [l for l in loads if l is not None]
  if not loads or max(loads) <= BUSY * cores:
    return []
  return [f"WARNING: busy machine? (1-min load average {', '.join(f'{l:.1f}' for l in loads)} "
          f"on {cores} cores, this benchmark's own threads included): {tail}", ""]


def format_results(results: dict) -> str:
  lines = busy_warning(results.get("device", {})) + section_tables(results)
  for name, err in results.get("errors", {}).items():
    lines += ["", f"section {name} FAILED: {err.strip().splitlines()[-1]}"]
  lines += ["", "Targets", ""] + targets_table(results.get("targets", []))
  return "\n".join(lines)

"""What a compiled step says about the pod: per-chip HBM against the chip's capacity,
a roofline step-time and MFU estimate, and the collective bytes per step.

Memory (XLA's `memory_analysis`, per chip): arguments + outputs - aliased (the donated
state is written in place) + temporaries + generated code: the peak the executable needs.

The roofline is an ESTIMATE, not a measurement: the step's compiled FLOPs over the chip's
published peak (a quantized step's int8 share over its int8 peak), its bytes
accessed over the HBM bandwidth, and its collective wire bytes
(train/aot/hlo.py) over the per-chip ICI bandwidth. `step_time_s` assumes the three
overlap perfectly (their maximum); `step_time_serial_s` that none does (their sum). MFU
uses the model's FLOPs (model/flops.py, the project's one formula), not the compiled
FLOPs, which also count rematerialisation.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any

from model.flops import (matmul_params_per_token, quantized_params_per_token,
                         training_flops_per_token)
from train.aot.compile import cost
from train.aot.hlo import collective_bytes, dcn_collectives, host_transfers, matmul_ops
from train.aot.topology import GiB, Topology
from train.io import storage


_UNITS = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def memory(executable) -> dict[str, int]:
  m = executable.memory_analysis()
  args, out, alias = (int(m.argument_size_in_bytes), int(m.output_size_in_bytes),
                      int(m.alias_size_in_bytes))
  temp, code = int(m.temp_size_in_bytes), int(m.generated_code_size_in_bytes)
  # Host memory (pinned_host) the program holds: what an offloading remat policy moved
  # off the chip (model/remat.py). Not in `total`, which is HBM.
  host = int(getattr(m, "host_temp_size_in_bytes", 0) or 0)
  return {"arguments": args, "outputs": out, "aliased": alias, "temporaries": temp,
          "code": code, "total": args + out - alias + temp + code, "host_temporaries": host}


def roofline(flops: float, bytes_accessed: float, wire_bytes: float, topo: Topology,
             int8_flops: float = 0.0) -> dict[str, float]:
  """`int8_flops` of the `flops` (int8 x int8 matmuls, model.quantization) run at the
  chip's int8 peak, the rest at its bfloat16 peak."""
  chip = topo.chip
  int8_flops = min(int8_flops, flops) if chip.int8_peak_flops else 0.0
  compute = (flops - int8_flops) / chip.peak_flops + (
      int8_flops / chip.int8_peak_flops if int8_flops else 0.0)
  times = {"compute_s": compute, "hbm_s": bytes_accessed / chip.hbm_bandwidth,
           "collective_s": wire_bytes / chip.ici_bandwidth}
  return {**times, "step_time_s": max(times.values()),
          "step_time_serial_s": sum(times.values()),
          "bound": max(times, key=times.get).removesuffix("_s")}


def capacity(topo: Topology) -> int:
  """The per-chip HBM every verdict is measured against: what XLA:TPU lets a program
  use (train/aot/topology.py Chip.usable_hbm_bytes), the same figure for a step that
  fits and one XLA refuses."""
  return topo.chip.usable_hbm_bytes or topo.chip.hbm_bytes


def _out_of_memory(compiled, topo: Topology) -> dict[str, Any]:
  """XLA:TPU's refusal ("... HLO temporaries (24.02G) exceeds available HBM (15.75G)")
  as figures: its temporaries, the arguments from their shardings; the HBM it names is
  kept as `xla_available_bytes` beside the one capacity (`capacity`)."""
  sizes = [float(v) * _UNITS[u] for v, u in
           re.findall(r"\((\d+(?:\.\d+)?)([KMGT])\)", compiled.out_of_memory)]
  hbm = capacity(topo)
  temps = sizes[0] if sizes else 0.0
  args = compiled.argument_bytes
  mem = {"arguments": args, "temporaries": int(temps), "total": int(args + temps)}
  return {"shapes": compiled.shapes, "compile_s": round(compiled.seconds, 2), "memory": mem,
          "hbm_bytes": hbm, "fits": False, "headroom_bytes": int(hbm - mem["total"]),
          "xla_available_bytes": int(sizes[1]) if len(sizes) > 1 else None,
          "out_of_memory": compiled.out_of_memory}


def step_report(compiled, topo: Topology) -> dict[str, Any]:
  """One step's memory per chip against the chip's HBM, and its collective traffic."""
  if compiled.executable is None:
    return _out_of_memory(compiled, topo)
  mem = memory(compiled.executable)
  hbm = capacity(topo)
  text = compiled.executable.as_text()
  return {"shapes": compiled.shapes, "compile_s": round(compiled.seconds, 2),
          "memory": mem, "hbm_bytes": hbm, "fits": mem["total"] <= hbm,
          "headroom_bytes": hbm - mem["total"], "collectives": collective_bytes(text),
          "matmuls": matmul_ops(text),
          "dcn_collectives": dcn_collectives(text), "host_transfers": host_transfers(text),
          "mosaic_kernels": text.count('custom_call_target="tpu_custom_call"'),
          "xla_cost": cost(compiled.executable)}


def add_roofline(train: dict, cost: dict[str, float], model_cfg, attention_impl: str,
                 topo: Topology) -> None:
  """The train step's roofline and MFU estimate, from XLA's cost of the compiled step
  (train/aot/compile.py probe_train_cost) and the model's FLOPs (model/flops.py).

  A Mosaic kernel's FLOPs are invisible to XLA's count: with Splash the attention
  scores' FLOPs (model/flops.py's formula, per chip) are added to the compute time."""
  tokens = train["shapes"]["batch"] * train["shapes"]["length"]
  per_token = training_flops_per_token(model_cfg, train["shapes"]["length"])
  attention = per_token - 6 * matmul_params_per_token(model_cfg)
  kernel_flops = attention * tokens / topo.num_chips if attention_impl == "splash" else 0.0
  flops = cost["flops"] + kernel_flops
  comm = train["collectives"]["total"]["wire_bytes"]
  # Where the compiled step multiplies int8 (hlo.py matmul_ops finds s8 dots), the
  # quantized dots' share of its FLOPs is the model's: 6 x the parameters they multiply
  # over the FLOPs per token. (The HLO's own per-dot FLOPs are nominal: a convolution's
  # padded window positions count, 3.2x XLA's cost on the 8b preset; they prove which
  # dots are int8, not how many FLOPs are.)
  quantized = bool(train.get("matmuls", {}).get("s8"))
  int8 = flops * 6 * quantized_params_per_token(model_cfg) / per_token if quantized else 0.0
  r = roofline(flops, cost["bytes_accessed"], comm, topo, int8)
  model_flops = per_token * tokens / topo.num_chips
  train.update(cost={**cost, "kernel_flops": kernel_flops}, roofline=r,
               model_flops_per_chip=model_flops,
               mfu_estimate=model_flops / r["step_time_s"] / topo.chip.peak_flops,
               mfu_estimate_serial=model_flops / r["step_time_serial_s"] / topo.chip.peak_flops,
               tokens_per_s_estimate=tokens / r["step_time_s"])


def gib(n: float) -> str:
  """Bytes for a reader: GiB, or MiB below one GiB."""
  return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / 2**20:.1f} MiB"


def advice(train: dict, remat_full: dict | None, lay_sizes: dict[str, int], model_cfg
           ) -> list[str]:
  """What would make a train step that does not fit fit: remat (compiled, when it was
  tried), a mesh that shards the state further, or a smaller per-chip batch."""
  mem, hbm = train["memory"], train["hbm_bytes"]
  over = mem["total"] - hbm
  lines = [f"does not fit: needs {gib(mem['total'])} per chip, {gib(over)} more than the "
           f"chip's {gib(hbm)}"]
  if remat_full is not None:
    m = remat_full["memory"]
    verdict = "fits" if remat_full["fits"] else f"still {gib(m['total'] - hbm)} over"
    lines.append(f"with --config.model.remat=full (compiled): {gib(m['total'])} per chip "
                 f"({gib(m['temporaries'])} temporaries): {verdict}")
  state = mem["arguments"]
  dp = lay_sizes.get("data", 1)
  if dp > 1 and state > 0.25 * hbm:
    lines.append(f"the state (parameters + optimizer) is {gib(state)} per chip, replicated "
                 f"over data={dp}: --config.mesh.data=1 --config.mesh.fsdp=-1 shards it "
                 f"over those chips too (about {gib(state / dp)} per chip, estimated)")
  if mem["temporaries"] > 0.5 * hbm:
    lines.append(f"temporaries are {gib(mem['temporaries'])}: raise "
                 f"--config.train.grad_accum (the micro-batch shrinks with it) or lower "
                 f"--config.data.batch_size / --config.data.seq_len")
  return lines


def write_report(report: dict[str, Any], out: str) -> None:
  """The report as JSON at `out`: a local path (its directories made) or a bucket URL,
  whole at once through train/io/storage.py (a reader never sees half a report)."""
  storage.write_text(out, json.dumps(report, indent=1))


# The fields that change what a step needs per chip: a report records what it compiled,
# so a reader can check that an override took effect (issue 46).
MEMORY_FIELDS = ("data.seq_len", "data.batch_size", "eval.batch_size", "train.grad_accum",
                 "model.remat", "model.remat_custom", "model.rope_scaling",
                 "model.rope_scaling_factor", "model.dtype", "model.param_dtype",
                 "model.scan_layers", "model.attention_impl", "model.loss_chunks")


def config_hash(config) -> str:
  """A short hash of the whole resolved config (the preset and every override)."""
  return hashlib.sha256(config.to_json_best_effort(sort_keys=True).encode()).hexdigest()[:8]


def config_record(config) -> dict[str, Any]:
  """What a report says it compiled: `config_fields`, the fields that change memory
  (`mesh` as the config asks it; the report's own `mesh` is it resolved), and
  `config_resolved`, the whole config after its overrides."""
  fields = {}
  for name in MEMORY_FIELDS:
    section, field = name.split(".")
    fields[name] = config[section].get(field)
  fields["mesh"] = dict(config.mesh)
  return {"config_fields": json.loads(json.dumps(fields, default=str)),
          "config_resolved": json.loads(config.to_json_best_effort()),
          "config_hash": config_hash(config)}


def default_out(config, topo: Topology, fit: bool) -> str:
  """`runs/compile/<name>-<topology>-b<batch>-L<seq_len>-<config hash>[-fit].json`: runs
  of other batches, lengths or overrides never share a file."""
  slices = f"x{topo.num_slices}" if topo.num_slices > 1 else ""
  return os.path.join("runs", "compile", f"{config.name if 'name' in config else 'run'}-"
                      f"{topo.name.replace(':', '_')}{slices}-b{int(config.data.batch_size)}-"
                      f"L{int(config.data.seq_len)}-{config_hash(config)}"
                      f"{'-fit' if fit else ''}.json")

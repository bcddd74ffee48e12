"""The step-time ESTIMATE that counts what the three-term roofline (train/aot/report.py
`roofline`: compute, HBM, ICI) leaves out: the host link an offloading remat policy
crosses, the vocabulary-tiled loss's per-chunk reads of the head, and what crosses
between slices (the data-centre network, DCN), pipeline stage transfers among it.

The model, per chip and per step; each term a time, from a compiler figure where there
is one:

  compute  XLA's FLOPs of the compiled step (+ Splash's, from model/flops.py) / peak
  HBM      XLA's bytes accessed, + the head's re-reads by the loss's chunks 2..n (XLA's
           cost counts a loop body once: a hand count, `head_reread_bytes`) / HBM bandwidth
  ICI      the compiled HLO's collective wire bytes on the chip interconnect (stage
           transfers inside a slice among them) / ICI bandwidth
  DCN      the bytes of the sends XLA hands to the Megascale runtime between slices
           (stage transfers across slices among them) / DCN bandwidth per chip
  host     the offloaded bytes out (forward) and back (backward): `memory_analysis`'s
           host buffers (host_temp_size_in_bytes), each written once and read once /
           the chip's host-link bandwidth

With pipeline stages (mesh.stage S > 1, M microbatches) the compute and HBM terms are
the probes' (compile.py probe_train_cost compiles them with the stages folded into
fsdp: the same chips, the same per-chip work) times GPipe's (M + S - 1) / M, every stage
also computing through the S - 1 bubble ticks; the collectives, the stage transfers
among them, are the pipelined step's own.

`step_time_s` is their maximum: the core's compute and HBM traffic, the async
collectives and the async host copies all overlapped perfectly (the optimistic bound);
`step_time_serial_s` their sum (nothing overlapped). The bandwidths are per chip
(train/aot/topology.py CHIPS, LINKS, with their sources).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from train.aot.topology import Topology, links

TERMS = ("compute", "hbm", "ici", "dcn", "host")


def head_reread_bytes(vocab_size: int, d_model: int, dtype: str, param_dtype: str,
                      chunks: int, tensor: int = 1) -> float:
  """HBM bytes per chip the loss's chunks 2..n add by reading the head again (a hand
  count: XLA's cost analysis counts the chunk loop's body once). Per chunk the head
  ([V / tensor, D] per chip: gathered along D, split over the vocabulary) is read three
  times in the compute `dtype` (the forward, its recompute in the backward, the input
  gradient; the cast from the parameters is loop-invariant) and its gradient
  accumulator, in `param_dtype`, read and written once."""
  if chunks < 1 or tensor < 1:
    raise ValueError(f"head re-reads: chunks={chunks}, tensor={tensor}: both must be >= 1")
  elements = vocab_size * d_model / tensor
  per_chunk = elements * (3 * jnp.dtype(dtype).itemsize + 2 * jnp.dtype(param_dtype).itemsize)
  return (chunks - 1) * per_chunk


def _rereads(step: dict, model_cfg, mesh: dict[str, int]) -> float:
  return head_reread_bytes(model_cfg.vocab_size, model_cfg.d_model, model_cfg.dtype,
                           model_cfg.param_dtype, int(step["cost"].get("loss_chunks", 1)),
                           mesh.get("tensor", 1))


def host_bytes(memory: dict[str, int]) -> float:
  """Bytes per chip per step over the host link: the host buffers out and back."""
  return 2.0 * memory.get("host_temporaries", 0)


def stage_transfers(step: dict, mesh: dict[str, int]) -> dict[str, float]:
  """The pipeline's stage-to-stage bytes per chip per step: the collective permutes on
  ICI (with a stage axis inside a slice; a context axis' ring permutes would count too)
  and those across slices (DCN)."""
  permutes = step.get("collectives", {}).get("collective-permute", {})
  dcn = step.get("dcn_collectives", {}).get("collective-permute", {})
  return {"ici": permutes.get("wire_bytes", 0.0) if mesh.get("stage", 1) > 1 else 0.0,
          "dcn": dcn.get("bytes", 0.0)}


def bubble_factor(stages: int, microbatches: int) -> float:
  """GPipe's ticks over its microbatches, (M + S - 1) / M: a stage's busy time grows by
  it (parallel/pipeline.py bubble_fraction is the idle share, (S - 1) / (M + S - 1))."""
  if stages < 1 or microbatches < 1:
    raise ValueError(f"pipeline of {stages} stages, {microbatches} microbatches: both >= 1")
  return (microbatches + stages - 1) / microbatches


def combine(times: dict[str, float]) -> dict[str, Any]:
  """Terms (seconds) -> the step time overlapped (max) and serial (sum), and the bound."""
  return {**{f"{k}_s": v for k, v in times.items()},
          "step_time_s": max(times.values()), "step_time_serial_s": sum(times.values()),
          "bound": max(times, key=times.get)}


def terms(step: dict, model_cfg, mesh: dict[str, int], topo: Topology,
          microbatches: int = 0) -> dict[str, float]:
  """The five terms (seconds) of a step report that has its roofline (report.py
  add_roofline); with stages, compute and HBM through the bubble (`microbatches`, 0: as
  many as stages)."""
  roof, chip, link = step["roofline"], topo.chip, links(topo.chip)
  reread = _rereads(step, model_cfg, mesh)
  S = mesh.get("stage", 1)
  k = bubble_factor(S, microbatches or S)
  return {"compute": roof["compute_s"] * k,
          "hbm": (roof["hbm_s"] + reread / chip.hbm_bandwidth) * k,
          "ici": roof["collective_s"],
          "dcn": step.get("dcn_collectives", {}).get("total", {}).get("bytes", 0.0) / link.dcn,
          "host": host_bytes(step["memory"]) / link.host}


def speed(step: dict, est: dict[str, Any], topo: Topology) -> dict[str, float]:
  """MFU and tokens/s of the step at the estimate's (overlapped and serial) step time."""
  tokens = step["shapes"]["batch"] * step["shapes"]["length"]
  peak = topo.chip.peak_flops
  return {"mfu": step["model_flops_per_chip"] / est["step_time_s"] / peak,
          "mfu_serial": step["model_flops_per_chip"] / est["step_time_serial_s"] / peak,
          "tokens_per_s": tokens / est["step_time_s"]}


def add_estimate(step: dict, model_cfg, mesh: dict[str, int], topo: Topology,
                 microbatches: int = 0) -> None:
  """`step["estimate"]`: the corrected ESTIMATE beside the roofline, with the bytes each
  added term counts (and a pipeline's bubble share)."""
  if "roofline" not in step:
    return
  est = combine(terms(step, model_cfg, mesh, topo, microbatches))
  S = mesh.get("stage", 1)
  if S > 1:
    est["bubble"] = (S - 1) / ((microbatches or S) + S - 1)
  est["bytes"] = {
      "head_rereads": _rereads(step, model_cfg, mesh),
      "host": host_bytes(step["memory"]),
      "dcn": step.get("dcn_collectives", {}).get("total", {}).get("bytes", 0.0),
      "stage_transfers": stage_transfers(step, mesh)}
  est["host_source"] = "memory_analysis host_temp_size_in_bytes, out and back"
  est.update(speed(step, est, topo))
  step["estimate"] = est


def estimate_line(est: dict[str, Any]) -> str:
  """The estimate as the compile report prints it."""
  ms = lambda k: f"{est[k] * 1e3:.1f} ms"
  return (f"{ms('step_time_s')} per step, {est['bound']}-bound (compute {ms('compute_s')}, "
          f"HBM {ms('hbm_s')}, ICI {ms('ici_s')}, DCN {ms('dcn_s')}, host link "
          f"{ms('host_s')}); MFU {est['mfu']:.1%} (no overlap: {est['mfu_serial']:.1%})")

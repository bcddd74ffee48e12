"""`--fit` on several slices: the pipeline's stages across the slices against fsdp across
them, each an ESTIMATE with the topology's DCN bandwidth, and the one to use
(docs/compile.md, "Across slices"; issue 47 item 6).

At the search's recommended remat policy and per-chip batch, two layouts of the same
chips are compiled, the axes inside a slice as the config has them:

  fsdp      mesh.dcn_fsdp = slices: every layer's weights gathered and its gradients
            reduced over the DCN, each step.
  pipeline  mesh.dcn_stage = slices: whole stages on slices (parallel/pipeline.py, GPipe);
            only activations (the stage transfers) and a few small sums cross the DCN.

The pipeline layout runs with `train.telemetry=False` (per-layer telemetry is sown inside
the layer scan, which the stages do not carry out): a logging choice, not a layout's, so
the comparison turns it off there and says so in the pipeline's flags. A layout libtpu
fails to compile is reported with the compiler's first line, and the other one compared.

fsdp's estimate is its compiled roofline plus what it leaves out (train/aot/estimate.py).
The pipeline's compute and HBM terms are fsdp's times GPipe's (M + S - 1) / M: the same
per-chip work, with every stage also computing through the S - 1 bubble ticks (XLA's
cost analysis counts the tick loop's body once, so the pipeline's own probes would not
see them); its ICI, DCN and host-link terms are its own compiled HLO's. The head runs
split over the stages' rows as well as the data axes (docs/scaling.md, "Pipeline parallelism"),
so fsdp's terms cover it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import jax

from train.aot.estimate import bubble_factor, combine, host_bytes
from train.aot.report import gib
from train.aot.topology import Topology, links

LAYOUTS = ("fsdp", "pipeline")
_KEPT = ("fits", "memory", "hbm_bytes", "collectives", "dcn_collectives", "estimate")
_UNCOMPILED = ("refused", "failed")  # The config check refused it; libtpu failed on it.


def _compiled(step: dict) -> bool:
  return not any(k in step for k in _UNCOMPILED)


def ranked_estimate(step: dict) -> dict[str, Any]:
  """What the search keeps of a roofline compile, and ranks on: the corrected estimate
  (train/aot/estimate.py) where there is one, else the roofline's."""
  est = step.get("estimate") or {}
  return {"memory": step["memory"], "hbm_bytes": step["hbm_bytes"],
          "step_time_s": est.get("step_time_s", step.get("roofline", {}).get("step_time_s")),
          "tokens_per_s_estimate": est.get("tokens_per_s", step.get("tokens_per_s_estimate")),
          "mfu_estimate": est.get("mfu", step.get("mfu_estimate")),
          "bound": est.get("bound"),
          "roofline_step_time_s": step.get("roofline", {}).get("step_time_s"),
          "estimate": est or None}


def pipeline_terms(fsdp: dict[str, float], step: dict, stages: int, microbatches: int,
                   topo: Topology) -> dict[str, float]:
  """The pipeline layout's terms (seconds): fsdp's compute and HBM through the bubble,
  its own compiled step's (`step`) ICI, DCN and host-link traffic."""
  k, link = bubble_factor(stages, microbatches), links(topo.chip)
  return {"compute": fsdp["compute_s"] * k, "hbm": fsdp["hbm_s"] * k,
          "ici": step["collectives"]["total"]["wire_bytes"] / topo.chip.ici_bandwidth,
          "dcn": step["dcn_collectives"]["total"]["bytes"] / link.dcn,
          "host": host_bytes(step["memory"]) / link.host}


def _layout(config, topo: Topology, name: str):
  c = copy.deepcopy(config)
  c.mesh.update({f"dcn_{a}": 1 for a in ("stage", "data", "fsdp", "context", "tensor",
                                          "expert")})
  c.mesh.update({f"dcn_{'stage' if name == 'pipeline' else 'fsdp'}": topo.num_slices})
  if name == "pipeline":
    c.train.telemetry = False  # Not carried out of the stages (train/spec: refused there).
  return c


def _as_searched(config, topo: Topology, name: str) -> bool:
  """Whether the search's own mesh is layout `name` (its recommended compile is that)."""
  want = _layout(config, topo, name).mesh
  return all(int(config.mesh[k]) == int(want[k]) for k in want
             if k.startswith("dcn_"))


def across_slices(config, topo: Topology, rec: dict, compile_train: Callable[..., dict],
                  with_batch: Callable, ledger) -> dict[str, Any]:
  """Both layouts at `rec`'s policy and per-chip batch: each one's fit, estimate and
  DCN bytes, and `recommended` (the faster that fits). `with_batch(config, b, remat,
  topo)` sets the batch and policy (fit.py); `ledger` keeps the compiles for a re-run."""
  remat, b, out = rec["remat"], rec["per_chip"], {"remat": rec["remat"],
                                                   "per_chip": rec["per_chip"]}
  steps = {}
  for name in LAYOUTS:
    key = f"{remat}|{name} across slices"
    t = ledger.find(key, b, roofline=True)
    if t is None and _as_searched(config, topo, name) and rec.get("estimate"):
      t = {"step": {"fits": True, "memory": rec["memory"], "estimate": rec["estimate"],
                    "dcn_collectives": {"total": {"bytes": rec["estimate"]["bytes"]["dcn"]}}}}
    if t is None:
      cfg = with_batch(_layout(config, topo, name), b, remat, topo)
      try:
        s = compile_train(cfg, topo, name == "fsdp")
        s = {k: s[k] for k in _KEPT if k in s}
      except ValueError as e:  # A layout the config cannot run (e.g. layers % stages).
        s = {"refused": str(e)}
      except jax.errors.JaxRuntimeError as e:  # One the compiler fails on.
        s = {"failed": str(e).strip().splitlines()[0][:400]}
      t = {"remat": key, "per_chip": b, "step": s}
      ledger.add(t, roofline=True)
    steps[name] = t["step"]
  fsdp, pipe = steps["fsdp"], steps["pipeline"]
  stages = int(config.mesh.stage or 1) * topo.num_slices
  micro = int(config.train.pipeline_microbatches or 0) or stages
  for name, s in steps.items():
    row: dict[str, Any] = {"mesh": f"dcn_{'stage' if name == 'pipeline' else 'fsdp'}="
                                   f"{topo.num_slices}"}
    if not _compiled(s):
      row.update({k: s[k] for k in _UNCOMPILED if k in s})
    else:
      row.update(fits=bool(s["fits"]), hbm_total=s["memory"]["total"],
                 dcn_bytes=s["dcn_collectives"]["total"]["bytes"])
    out[name] = row
  if _compiled(fsdp) and fsdp.get("estimate"):
    out["fsdp"]["estimate"] = combine({k: fsdp["estimate"][f"{k}_s"] for k in
                                       ("compute", "hbm", "ici", "dcn", "host")})
    if _compiled(pipe):
      out["pipeline"].update(stages=stages, microbatches=micro,
                             bubble=(stages - 1) / (micro + stages - 1))
      out["pipeline"]["estimate"] = combine(pipeline_terms(fsdp["estimate"], pipe, stages,
                                                           micro, topo))
  out.update(_choose(out, config, topo))
  return out


def _mesh_flags(config, topo: Topology, name: str) -> str:
  """The flags that turn the searched config into layout `name` ("": none): its mesh, and
  the pipeline's telemetry off."""
  want = _layout(config, topo, name)
  flags = [f"--config.mesh.{k}={int(want.mesh[k])}" for k in sorted(want.mesh)
           if k.startswith("dcn_") and int(config.mesh[k]) != int(want.mesh[k])]
  if bool(config.train.telemetry) != bool(want.train.telemetry):
    flags.append(f"--config.train.telemetry={want.train.telemetry}")
  return " ".join(flags)


def _choose(out: dict, config, topo: Topology) -> dict[str, Any]:
  ok = [n for n in LAYOUTS if out[n].get("fits") and "estimate" in out[n]]
  if not ok:
    return {"recommended": None, "why": "neither layout fits with an estimate"}
  best = min(ok, key=lambda n: out[n]["estimate"]["step_time_s"])
  flag = _mesh_flags(config, topo, best)
  other = [n for n in ok if n != best]
  why = (f"{best} across slices: {out[best]['estimate']['step_time_s'] * 1e3:.1f} ms per "
         f"step against {other[0]}'s {out[other[0]]['estimate']['step_time_s'] * 1e3:.1f} "
         "ms (ESTIMATE)" if other else f"only {best} fits")
  return {"recommended": best, "flags": flag, "why": why,
          "dcn_bandwidth_per_chip": links(topo.chip).dcn}


def slices_lines(r: dict[str, Any]) -> list[str]:
  """The comparison as format_fit prints it."""
  a = r.get("across_slices")
  if not a:
    return []
  if "remat" not in a:
    return [f"across slices: no comparison ({a['why']})"]
  lines = [f"across {r['num_slices']} slices at remat={a['remat']}, {a['per_chip']} per "
           f"chip (DCN {a.get('dcn_bandwidth_per_chip', 0) / 1e9:.2f} GB/s per chip):"]
  for name in LAYOUTS:
    row = a[name]
    if not _compiled(row):
      said = (f"refused: {row['refused']}" if "refused" in row
              else f"failed to compile: {row['failed']}")
      lines.append(f"  {name:<8} ({row['mesh']}): {said}")
      continue
    est = row.get("estimate")
    speed = (f"{est['step_time_s'] * 1e3:.1f} ms per step, {est['bound']}-bound, DCN "
             f"{est['dcn_s'] * 1e3:.1f} ms (ESTIMATE)" if est else "no estimate")
    bubble = f", bubble {row['bubble']:.0%}" if "bubble" in row else ""
    lines.append(f"  {name:<8} ({row['mesh']}): {gib(row['hbm_total'])} per chip, "
                 f"{'fits' if row['fits'] else 'DOES NOT FIT'}; {gib(row['dcn_bytes'])} over "
                 f"the DCN per chip{bubble}; {speed}")
  if a.get("recommended"):
    lines.append(f"across slices: {a['flags'] or 'the searched mesh'} ({a['why']})")
  else:
    lines.append(f"across slices: no recommendation ({a['why']})")
  return lines

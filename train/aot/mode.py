"""`launch.py --mode compile`: compile a config's train, eval and decode steps for a TPU
topology on this host, and the report a user reads (docs/compile.md).

  report = compile_for_topology(config, "v5p:4x4x4")    # train, eval, decode steps
  print(format_report(report))
"""

from __future__ import annotations

import copy
import time
from typing import Any

from model.attention.impls import resolve_attention_impl
from model.backend import target_backend
from parallel import mesh_context
from train.aot import report as rep
from train.aot.compile import (compile_decode, compile_eval, compile_train, mesh_sizes,
                               num_params, probe_train_cost, validate_for)
from train.aot.estimate import add_estimate, estimate_line
from train.aot.topology import Topology, parse_topology, prepare_host, topology_devices
from train.lifecycle import session

STEPS = ("train", "eval", "decode")


def compile_for_topology(config, topology: str | Topology, num_slices: int = 1,
                         steps=STEPS, try_remat: bool = True, roofline: bool = True,
                         verbose: bool = True) -> dict[str, Any]:
  """Compiles `steps` of `config` for `topology` on this host; returns the figures.

  A train step that does not fit is compiled once more at model.remat="full" (unless
  it already is, or `try_remat` is False), so the report says whether that would do.
  `roofline`: estimate the train step's time and MFU (two more small compiles).
  `verbose`: print the train step's verdict as soon as it is known.
  """
  topo = topology if isinstance(topology, Topology) else parse_topology(topology, num_slices)
  unknown = sorted(set(steps) - set(STEPS))
  if unknown:
    raise ValueError(f"steps {unknown}: must be among {STEPS}")
  t0 = time.perf_counter()
  prepare_host()
  spec = validate_for(config, topo)
  model_cfg = spec.model
  devices = topology_devices(topo)
  builders = {"train": compile_train, "eval": compile_eval, "decode": compile_decode}
  out: dict[str, Any] = {"topology": topo.name, "num_slices": topo.num_slices,
                         "chips": topo.num_chips, "chip": topo.chip.generation,
                         "config": spec.name, **rep.config_record(config), "steps": {}}
  with target_backend("tpu"):
    lay = session.open_run(spec, None, "compile", devices)
    out.update(mesh=mesh_sizes(lay), params=num_params(lay),
               remat=model_cfg.remat, dtype=model_cfg.dtype)
    with mesh_context(lay.mesh, lay.rules):
      # Under the mesh: context and pipeline stages change what "auto" runs.
      out["attention_impl"] = _attention_impls(model_cfg, spec)
      # The train step first, and its verdict (with remat=full's when it does not fit)
      # logged at once: the eval / decode steps and the roofline's probes come after.
      for name in sorted(steps, key=lambda n: n != "train"):
        compiled = builders[name](spec, lay)
        out["steps"][name] = rep.step_report(compiled, topo)
        if name == "train":
          _train_verdict(out, spec, lay, model_cfg, topo, try_remat)
          out["verdict_s"] = round(time.perf_counter() - t0, 1)
          if verbose:
            print(f"train step: {_verdict_words(out)} (after {out['verdict_s']:.0f} s; "
                  f"{', '.join(n for n in steps if n != 'train') or 'nothing'} to compile"
                  f"{', then the roofline' if roofline else ''})", flush=True)
      out["steps"] = {n: out["steps"][n] for n in steps}  # The order asked for.
    if "train" in out["steps"] and roofline:
      t1 = time.perf_counter()
      _roofline(out, config, lay, devices, topo)
      out["roofline_s"] = round(time.perf_counter() - t1, 1)
  out["fits"] = all(s["fits"] for s in out["steps"].values())
  out["seconds"] = round(time.perf_counter() - t0, 1)
  return out


def _train_verdict(out: dict, config, lay, model_cfg, topo: Topology, try_remat: bool
                   ) -> None:
  """A train step that does not fit: remat=full compiled too (unless it is already full,
  or not asked for), and the advice."""
  train = out["steps"]["train"]
  if train["fits"]:
    return
  remat_full = None
  if try_remat and model_cfg.remat != "full":
    # A custom policy's map (a preset's offload) is read only with remat='custom'.
    full = compile_train(config, lay, model_cfg.replace(remat="full", remat_custom=""))
    remat_full = rep.step_report(full, topo)
    out["remat_full"] = remat_full
  out["advice"] = rep.advice(train, remat_full, out["mesh"], model_cfg)


def _verdict_words(out: dict) -> str:
  train = out["steps"]["train"]
  if train["fits"]:
    return "fits"
  full = out.get("remat_full")
  return "does not fit" + ("" if full is None else
                           f"; at remat=full it {'fits' if full['fits'] else 'does not'}")


def _roofline(out: dict, config, lay, devices, topo: Topology) -> None:
  """The estimate for the train step, or (it does not fit) for its remat=full twin."""
  target, cfg = out["steps"]["train"], config
  if not target["fits"] and out.get("remat_full", {}).get("fits"):
    target, cfg = out["remat_full"], copy.deepcopy(config)
    cfg.model.remat, cfg.model.remat_custom = "full", ""
  if not target["fits"]:
    return
  cost = probe_train_cost(cfg, lay, devices, target.get("xla_cost"))
  if cost is not None:
    model_cfg = validate_for(cfg, topo).model
    rep.add_roofline(target, cost, model_cfg,
                     out["attention_impl"]["train"],
                     topo)
    add_estimate(target, model_cfg, out["mesh"], topo,  # What the roofline leaves out.
                 int(cfg.train.pipeline_microbatches or 0))


def _attention_impls(model_cfg, config) -> dict[str, str]:
  """What "auto" (or the explicit choice) runs on TPU, per step."""
  seq_len = int(config.data.seq_len)
  return {"train": resolve_attention_impl(model_cfg, "tpu", seq_len),
          "eval": resolve_attention_impl(model_cfg, "tpu", seq_len), "decode": "xla"}


def roof_line(roof: dict) -> str:
  ms = lambda key: f"{roof[key] * 1e3:.1f} ms"
  return (f"{ms('step_time_s')} per step, {roof['bound']}-bound (compute "
          f"{ms('compute_s')}, HBM {ms('hbm_s')}, collectives {ms('collective_s')})")


def _roofline_lines(s: dict, where: str) -> list[str]:
  if "roofline" not in s:
    return []
  return [f"         roofline ESTIMATE{where}: {roof_line(s['roofline'])}; MFU "
          f"{s['mfu_estimate']:.1%} (no overlap: {s['mfu_estimate_serial']:.1%})"]


def _estimate_lines(s: dict, where: str) -> list[str]:
  """The corrected estimate (train/aot/estimate.py): the roofline plus host link, DCN
  and the loss head's re-reads."""
  if "estimate" not in s:
    return []
  return [f"         step ESTIMATE{where} (+ host link, DCN, head re-reads): "
          f"{estimate_line(s['estimate'])}"]


def _dcn_words(dcn: dict) -> str:
  """The sends that cross the data-centre network, per kind (train/aot/hlo.py)."""
  kinds = [f"{v['count']:.0f} {k} ({v['bytes'] / 1e6:.2f} MB)" for k, v in dcn.items()
           if k != "total"]
  return (", ".join(kinds) or "nothing") + " per chip"


def _matmul_words(mm: dict) -> str:
  """"96 s8 (28.5 TFLOP), 64 bf16 (17.2 TFLOP)": dots by operand type, per chip and step."""
  kinds = sorted((k for k in mm if k != "total"), key=lambda k: -mm[k]["flops"])
  flop = lambda f: (f"{f / 1e12:.3g} TFLOP" if f >= 1e11 else f"{f / 1e6:.3g} MFLOP") + " nominal"
  return ", ".join(f"{mm[k]['count']:.0f} {k} ({flop(mm[k]['flops'])})"
                   for k in kinds) or "none"


def format_report(r: dict[str, Any]) -> str:
  """The report as a user reads it: one block per step, the verdict last."""
  gib = rep.gib
  slices = f" x {r['num_slices']} slices" if r["num_slices"] > 1 else ""
  lines = [f"{r['config']} on {r['topology']}{slices}: {r['chips']} TPU {r['chip']} chips, "
           f"mesh {r['mesh']}, {r['params'] / 1e6:.1f}M parameters, {r['dtype']}, "
           f"remat={r['remat']}, attention {r['attention_impl']['train']}"]
  for name, s in r["steps"].items():
    m = s["memory"]
    lines.append(f"  {name:<6} {s['shapes']}  compiled in {s['compile_s']:.1f} s")
    lines.append(f"         HBM per chip: arguments {gib(m['arguments'])}, temporaries "
                 f"{gib(m['temporaries'])}, total {gib(m['total'])} of {gib(s['hbm_bytes'])}"
                 f" -> {'fits' if s['fits'] else 'DOES NOT FIT'}")
    if m.get("host_temporaries"):
      lines.append(f"         host memory (remat offload): {gib(m['host_temporaries'])}")
    if "collectives" in s:
      comm = s["collectives"]["total"]
      lines.append(f"         collectives per step: {comm['count']:.0f} ops, "
                   f"{comm['wire_bytes'] / 1e6:.1f} MB per chip over ICI")
      if r["num_slices"] > 1:
        lines.append(f"         across slices (DCN): {_dcn_words(s['dcn_collectives'])}")
    if "matmuls" in s:
      lines.append(f"         matmuls per step: {_matmul_words(s['matmuls'])}")
    lines += _roofline_lines(s, "") + _estimate_lines(s, "")
  lines += [f"  {a}" for a in r.get("advice", ())]
  lines += _roofline_lines(r.get("remat_full", {}), " at remat=full")
  lines += _estimate_lines(r.get("remat_full", {}), " at remat=full")
  times = [f"compiled in {r['seconds']:.0f} s"]
  if "verdict_s" in r:
    times.append(f"the train step's verdict after {r['verdict_s']:.0f} s")
  if "roofline_s" in r:
    times.append(f"the roofline's probes {r['roofline_s']:.0f} s (--noroofline skips them)")
  lines.append(("FITS" if r["fits"] else "DOES NOT FIT") + f" on {r['topology']}{slices} "
               f"({'; '.join(times)})")
  return "\n".join(lines)

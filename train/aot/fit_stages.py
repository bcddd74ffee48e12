"""`--fit --fit_stages=1,2,4`: the search over pipeline stages and microbatches inside a
slice (docs/compile.md, "Pipeline stages inside a slice: `--fit_stages`"; issue 47).

For each stage count S > 1 the config allows (train/spec/checks.py: dense, scanned,
the layers in S equal stages of whole pattern periods), mesh.stage = S is searched like
the unpipelined mesh: per remat policy (fit.py's order and ceilings) the largest per-chip
batch whose train step fits, memory-only compiles at M = S microbatches, each kept in
the ledger under "<policy>|stage=S,micro=M". The microbatch counts M = k * S for k in
--fit_microbatches (default 1, 2, 4) that the per-chip batch b allows (each microbatch
split over the data axes: b * S / M whole sequences per chip at tick) are then compiled
at the fastest policy only (two more compiles per S at most), since M moves the bubble
and the per-tick transfers, not the policy ranking.

Each candidate's ESTIMATE (fit_slices.py pipeline_terms): the unpipelined step's
compute and HBM terms at the same policy (its roofline compile, scaled by the per-chip
batch b / b1 where the unpipelined search fit b1 sequences), times GPipe's
(M + S - 1) / M (the bubble); the ICI, DCN and host-link terms from the candidate's
own compiled HLO and memory_analysis, its stage transfers (collective permutes) and
the per-tick weight gathers among them. A policy that fits nothing unpipelined has no
compute term to scale: its candidates are listed without an estimate, ranked last.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

from parallel import mesh as mesh_lib
from train.aot.compile import validate_for
from train.aot.estimate import combine
from train.aot.fit_slices import pipeline_terms
from train.aot.report import gib
from train.aot.topology import Topology

DEFAULT_FACTORS = (1, 2, 4)  # --fit_microbatches: M = k * S.


def pipelined(config, stages: int, microbatches: int):
  """`config` with the layer stack in `stages` stages of `microbatches` microbatches (a
  fixed mesh.fsdp gives them its chips), and per-layer telemetry off (the pipeline
  refuses it; the recommended flags say so)."""
  c = copy.deepcopy(config)
  fsdp = int(c.mesh.fsdp)
  if fsdp != -1 and stages > 1 and fsdp % stages == 0:  # The stages take chips from fsdp.
    c.mesh.fsdp = fsdp * int(c.mesh.stage or 1) // stages
  c.mesh.stage = stages
  c.train.pipeline_microbatches = microbatches if stages > 1 else 0
  if stages > 1:
    c.train.telemetry = False
  return c


def label(stages: int, microbatches: int) -> str:
  return f"stage={stages},micro={microbatches}"


def refusal(config, topo: Topology, stages: int) -> str | None:
  """Why the config cannot run `stages` stages on `topo` (None: it can), from the run
  spec's own checks at one sequence per chip and M = S."""
  c = pipelined(config, stages, stages)
  c.data.batch_size = c.eval.batch_size = topo.num_chips
  try:
    validate_for(c, topo)
  except ValueError as e:
    return str(e)
  return None


def microbatch_counts(config, topo: Topology, stages: int, per_chip: int,
                      factors: Sequence[int]) -> list[int]:
  """M = k * S for k in `factors` whose microbatches split evenly over the data axes."""
  c = pipelined(config, stages, stages)
  sizes = mesh_lib.mesh_shape(c.mesh, topo.num_chips)
  dp = sizes["data"] * sizes["fsdp"] * sizes["expert"]
  batch = per_chip * topo.num_chips // max(1, int(config.train.grad_accum or 1))
  return [k * stages for k in dict.fromkeys(factors) if batch % (k * stages * dp) == 0]


def candidate_estimate(ref: dict | None, step: dict, stages: int, micro: int,
                       topo: Topology, per_chip: int, seq_len: int) -> dict[str, Any] | None:
  """The candidate's ESTIMATE: `ref` (the unpipelined row's estimate and per-chip batch
  at the same policy) scaled to this batch, through the bubble, with `step`'s own
  transfers (module docstring)."""
  if not ref or not ref.get("estimate") or "collectives" not in step:
    return None
  scale, tokens = per_chip / ref["per_chip"], per_chip * topo.num_chips * seq_len
  base = {k: ref["estimate"][k] * scale for k in ("compute_s", "hbm_s")}
  est = combine(pipeline_terms(base, step, stages, micro, topo))
  est.update(bubble=(stages - 1) / (micro + stages - 1),
             tokens_per_s=tokens / est["step_time_s"])
  return est


def search_stages(search, names: Sequence[str], stages: Sequence[int],
                  factors: Sequence[int], refs: dict[str, dict],
                  largest: Callable[..., tuple[int | None, float | None]],
                  ceiling: int, start: int) -> list[dict[str, Any]]:
  """The pipeline candidates (fit.py fit_search's `search`, policy order `names`, the
  unpipelined rows `refs` by policy): one row per (S, M, policy) compiled."""
  rows: list[dict[str, Any]] = []
  for S in sorted(set(int(s) for s in stages) - {1}):
    why = refusal(search.config, search.topo, S)
    if why is not None:
      rows.append({"stages": S, "refused": why})
      continue
    try:
      rows += _one_stage_count(search, names, S, factors, refs, largest, ceiling, start)
    except Exception as e:  # pylint: disable=broad-except
      # A candidate the pipeline cannot trace or compile ends its stage count, not the
      # search: the error is its row (and the other stage counts still run).
      lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [""]
      rows.append({"stages": S, "refused": f"the compile failed: {type(e).__name__}: "
                                           f"{' '.join(lines[:2])[:400]}"})
  return rows


def _one_stage_count(search, names, S, factors, refs, largest, ceiling, start):
  top, b0, slope, found = ceiling, start, None, []
  for remat in names:
    if top is None:
      break
    trial = lambda b, r=remat: search.trial(r, b, (label(S, S), pipelined, (S, S)))
    first = max(b0, (refs.get(remat) or {}).get("per_chip") or 1)  # Fits unpipelined.
    best, slope = largest(trial, min(first, top), top, slope)
    if best is not None:
      found.append(_row(search, remat, best, S, S, refs))
      b0 = best
    if remat != "custom":
      top = best
  if not found:
    return [{"stages": S, "microbatches": S, "per_chip": None,
             "why": "no policy fits one sequence per chip"}]
  lead = max(found, key=_speed)
  for M in microbatch_counts(search.config, search.topo, S, lead["per_chip"], factors):
    if M != S:
      ok, _ = search.trial(lead["remat"], lead["per_chip"],
                           (label(S, M), pipelined, (S, M)))
      found.append(_row(search, lead["remat"], lead["per_chip"], S, M, refs) if ok else
                   {"stages": S, "microbatches": M, "remat": lead["remat"],
                    "per_chip": None, "why": f"{lead['per_chip']} per chip does not fit "
                    f"at {M} microbatches"})
  return found


def _row(search, remat: str, b: int, S: int, M: int, refs: dict) -> dict[str, Any]:
  key = f"{remat}|{label(S, M)}"  # Read, not reused: the trial was just asked for.
  t = next(t for t in search.ledger.trials if (t["remat"], t["per_chip"]) == (key, b))
  est = candidate_estimate(refs.get(remat), t, S, M, search.topo, b,
                           int(search.config.data.seq_len))
  return {"stages": S, "microbatches": M, "remat": remat, "per_chip": b,
          "memory": t["memory"], "hbm_bytes": t["hbm_bytes"], "estimate": est,
          "step_time_s": est and est["step_time_s"],
          "tokens_per_s_estimate": est and est["tokens_per_s"],
          **({} if est else {"why": f"no unpipelined estimate at remat={remat} to scale"})}


def _speed(row: dict) -> float:
  return row.get("tokens_per_s_estimate") or 0.0


def recommend(unpipelined: dict | None, rows: list[dict], chips: int, config
              ) -> dict[str, Any] | None:
  """The fastest candidate by its ESTIMATE, the unpipelined recommendation among them, with
  its flags and a sentence saying why; None when nothing fits."""
  fitting = [r for r in rows if r.get("per_chip")]
  pool = ([{**unpipelined, "stages": 1, "microbatches": 0}] if unpipelined else []) + fitting
  if not pool:
    return None
  best = max(pool, key=lambda r: (_speed(r), r["per_chip"], -r["stages"]))
  flags = (f"--config.data.batch_size={best['per_chip'] * chips} "
           f"--config.model.remat={best['remat']}")
  if config.model.remat_custom and best["remat"] != "custom":
    flags += " --config.model.remat_custom="
  if best["stages"] > 1:
    fsdp = int(pipelined(config, best["stages"], best["microbatches"]).mesh.fsdp)
    flags += f" --config.mesh.fsdp={fsdp}" if fsdp != int(config.mesh.fsdp) else ""
    flags += (f" --config.mesh.stage={best['stages']} "
              f"--config.train.pipeline_microbatches={best['microbatches']}")
    flags += " --config.train.telemetry=False" if config.train.telemetry else ""
  others = sorted((r for r in pool if r is not best and _speed(r)), key=_speed, reverse=True)
  what = _what(best)
  why = (f"{what}: {_speed(best) / chips:,.0f} tokens/s/chip (ESTIMATE) against "
         f"{_what(others[0])}'s {_speed(others[0]) / chips:,.0f}" if others and _speed(best)
         else f"{what}: the only candidate that fits with an estimate" if _speed(best)
         else f"{what}: the most sequences per chip (no estimate to rank on)")
  return {**best, "flags": flags, "why": why}


def _what(r: dict) -> str:
  pipe = (f"{r['stages']} stages x {r['microbatches']} microbatches"
          if r["stages"] > 1 else "no pipeline")
  return f"{pipe}, remat={r['remat']}, {r['per_chip']} per chip"


def stage_lines(r: dict[str, Any]) -> list[str]:
  """The stage search as format_fit prints it."""
  rows = r.get("pipeline")
  if rows is None:
    return []
  lines = ["pipeline stages (GPipe; ESTIMATE: the unpipelined compute and HBM through the "
           "bubble, the candidate's own transfers):"]
  for row in rows:
    if "refused" in row:
      lines.append(f"  stages={row['stages']}: refused: {row['refused']}")
      continue
    head = f"  stages={row['stages']} x {row['microbatches']} microbatches"
    if not row.get("per_chip"):
      lines.append(f"{head}: {row.get('remat', '')} {row['why']}".rstrip())
      continue
    est = row.get("estimate")
    speed = (f"bubble {est['bubble']:.0%}, {est['step_time_s'] * 1e3:.3g} ms per step, "
             f"{est['bound']}-bound, {est['tokens_per_s'] / r['chips']:,.0f} tokens/s/chip "
             "(ESTIMATE)" if est else row["why"])
    lines.append(f"{head}, remat={row['remat']:<14} {row['per_chip']:>4} per chip: "
                 f"{gib(row['memory']['total'])} of {gib(row['hbm_bytes'])}; {speed}")
  rec = r.get("recommended") or {}
  if rec.get("why"):
    lines.append(f"pipeline choice: {rec['why']}")
  return lines

"""`launch.py --mode compile --fit`: the largest per-chip batch whose train step fits, per
remat policy, and the `--config` flags to use (docs/compile.md).

  result = fit_search(config, "v5e-16", policies=("full", "save_qkv_proj"), out="fit.json")
  print(format_fit(result))

The search compiles the train step only and reads `memory_analysis`. Policies go from the
most recompute (`full`, the least HBM) upward: a policy that keeps more for the backward
pass never fits a larger batch than the one before it, so that batch is the next policy's
first trial and its ceiling. Within a policy HBM per chip is close to linear in the
batch: from two measured batches the search predicts the largest that fits and compiles
only to confirm it (and that one more does not), bisecting where predictions keep
missing. Every trial goes into the JSON as it finishes (train/aot/fit_ledger.py): a
re-run with the same arguments reuses them, and SIGTERM keeps them. With the roofline on,
each policy's batch is compiled once more for its estimate (report.py add_roofline, and
what it leaves out: estimate.py), which ranks the policies. On several slices the
recommended one is then compiled with the pipeline's stages across the slices and with
fsdp across them, and the faster recommended (fit_slices.py).

A per-chip batch of b is data.batch_size = b * chips (every chip one share of the batch).
"""

from __future__ import annotations

import copy
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from model.config import REMAT_POLICIES
from train.aot.fit_ledger import Ledger, exit_on_sigterm, search_key
from train.aot.fit_slices import across_slices, ranked_estimate, slices_lines
from train.aot.fit_stages import (DEFAULT_FACTORS, pipelined, recommend, search_stages,
                                  stage_lines)
from train.aot.mode import compile_for_topology
from train.aot.report import capacity, config_record, gib
from train.aot.topology import Topology, parse_topology, topology_devices

# Most device HBM first as compiled for TPU (benchmarks/remat_memory.py, v5e:2x2:
# docs/model.md, "Remat policies"): none recomputes nothing, full everything. save_dots
# keeps the float32 matmul outputs (more HBM than minimal_with_context, which recomputes
# less); an offloaded policy recomputes what its twin does and comes after it; measured,
# qkv_proj_offloaded holds as much HBM as save_qkv_proj. The search walks it backwards.
RECOMPUTE_ORDER = ("none", "save_dots", "minimal_with_context", "minimal",
                   "minimal_offloaded", "save_dot_except_mlp", "save_qkv_proj",
                   "qkv_proj_offloaded", "save_out_proj", "full")
DEFAULT_POLICIES = ("full", "save_qkv_proj", "minimal")  # --fit_policies' default.
MAX_PER_CHIP = 256  # Sequences per chip: the search's ceiling.
PREDICTIONS = 3  # Linear predictions per policy before the search bisects.


def policies(names: Sequence[str] | None = None) -> list[str]:
  """--fit_policies in search order: `custom` (the config's own map, which may offload
  below full) first, then full, then upward in HBM (RECOMPUTE_ORDER backwards; a named
  policy it does not list just after full). "all": every named policy but custom."""
  names = list(DEFAULT_POLICIES if names is None else names)
  if names == ["all"]:
    names = [p for p in REMAT_POLICIES if p != "custom"]
  unknown = [n for n in names if n not in REMAT_POLICIES]
  if unknown or not names:
    raise ValueError(f"--fit_policies={','.join(names)}: {unknown or 'none given'}; "
                     f"name remat policies among {', '.join(REMAT_POLICIES)}, or all")
  rank = {p: len(RECOMPUTE_ORDER) - 1 - i for i, p in enumerate(RECOMPUTE_ORDER)}
  return sorted(dict.fromkeys(names), key=lambda p: -1 if p == "custom" else rank.get(p, .5))


Measure = Callable[[int], tuple[bool, float]]


def largest_fitting(measure: Measure, start: int, ceiling: int = MAX_PER_CHIP,
                    capacity: float | None = None, slope: float | None = None
                    ) -> tuple[int | None, float | None]:
  """The largest b in [1, ceiling] that fits, assuming what fits at b fits below it (None:
  not even 1), and the HBM bytes per sequence the trials measured. `measure(b)` -> (fits,
  HBM bytes); each b is measured once. With `capacity`, the next b is the one a line
  through the two trials nearest the boundary predicts (`slope`, e.g. another policy's,
  stands in while there is one trial), then its neighbour to confirm it."""
  if start < 1 or ceiling < 1:
    raise ValueError(f"per-chip batch search from {start} up to {ceiling}: both must be >= 1")
  seen: dict[int, tuple[bool, float]] = {}
  b, guesses = min(start, ceiling), 0
  while True:
    seen[b] = measure(b)
    lo = max((k for k, (ok, _) in seen.items() if ok), default=0)
    hi = min((k for k, (ok, _) in seen.items() if not ok), default=ceiling + 1)
    measured = _slope(seen, lo, hi)
    if hi - lo <= 1:
      return lo or None, measured or slope
    guess = None
    if capacity is not None and guesses < PREDICTIONS and (measured or slope):
      guess = _predict(seen, lo, hi, capacity, measured or slope)
      guesses += 1
    b = max(lo + 1, min(guess, hi - 1)) if guess is not None else _bisect(lo, hi, ceiling)


def _slope(seen: dict[int, tuple[bool, float]], lo: int, hi: int) -> float | None:
  """Bytes per sequence through the two trials nearest the fit boundary."""
  fit = sorted(k for k, (ok, m) in seen.items() if ok and m > 0)
  over = sorted(k for k, (ok, m) in seen.items() if not ok and m > 0)
  pair = (fit[-1], over[0]) if fit and over else (fit[-2:] if fit else over[:2])
  if len(pair) < 2 or pair[0] == pair[1]:
    return None
  (b1, b2), (m1, m2) = pair, (seen[pair[0]][1], seen[pair[1]][1])
  s = (m2 - m1) / (b2 - b1)
  return s if s > 0 else None


def _predict(seen, lo: int, hi: int, capacity: float, slope: float) -> int:
  anchor = lo if lo in seen else hi
  return anchor + math.floor((capacity - seen[anchor][1]) / slope)


def _bisect(lo: int, hi: int, ceiling: int) -> int:
  if lo == 0:
    return hi // 2
  return min(2 * lo, ceiling) if hi > ceiling else (lo + hi) // 2


def _with(config, per_chip: int, remat: str, topo: Topology):
  c = copy.deepcopy(config)
  c.data.batch_size = per_chip * topo.num_chips
  c.eval.batch_size = per_chip * topo.num_chips
  if remat == "custom" and not c.model.remat_custom:
    raise ValueError("--fit_policies names custom, but the config has no "
                     "model.remat_custom map to search with")
  c.model.remat = remat
  if remat != "custom":
    c.model.remat_custom = ""  # A preset's offload map belongs to its custom policy.
  return c


def _compile_train(config, topo: Topology, roofline: bool) -> dict[str, Any]:
  return compile_for_topology(config, topo, steps=("train",), try_remat=False,
                              roofline=roofline, verbose=False)["steps"]["train"]


def _clock(seconds: float) -> str:
  m, s = divmod(int(round(seconds)), 60)
  return f"{m} min {s:02d} s" if m else f"{s} s"


class _Search:
  """One search's state: the ledger, the clock, the result written after every trial."""

  def __init__(self, config, topo, ledger, compile_train, arm, names):
    self.config, self.topo, self.ledger = config, topo, ledger
    self.compile_train, self.arm, self.names = compile_train, arm, names
    self.t0, self.rows = time.perf_counter(), []

  def result(self, finished: bool) -> dict[str, Any]:
    c, topo = self.config, self.topo
    out = {"topology": topo.name, "num_slices": topo.num_slices, "chips": topo.num_chips,
           "config": c.name, "seq_len": int(c.data.seq_len), "fit_policies": self.names,
           "policies": self.rows, "finished": finished,
           "seconds": round(time.perf_counter() - self.t0, 1), **config_record(c)}
    fitting = [r for r in self.rows if r["per_chip"] is not None]
    if finished and fitting:
      out["recommended"] = _recommend(fitting, topo.num_chips, c)
    out["fits"] = "recommended" in out
    return {**out, "search_key": self.ledger.key, "trials": self.ledger.trials,
            "rooflines": self.ledger.rooflines}

  def trial(self, remat: str, b: int, layout: tuple | None = None) -> tuple[bool, float]:
    """`layout`: (label, fn, args) compiles fn(config, *args) (fit_stages.py), kept in
    the ledger as "<remat>|<label>"."""
    key = f"{remat}|{layout[0]}" if layout else remat
    t = self.ledger.find(key, b)
    how = "from the ledger of an earlier run"
    if t is None:
      self.arm()
      cfg = _with(self.config, b, remat, self.topo)
      s = self.compile_train(layout[1](cfg, *layout[2]) if layout else cfg, self.topo, False)
      t = {"remat": key, "per_chip": b, "fits": bool(s["fits"]),
           "total": s["memory"]["total"], "memory": s["memory"], "hbm_bytes": s["hbm_bytes"],
           "compile_s": s.get("compile_s"),
           "elapsed_s": round(time.perf_counter() - self.t0, 1)}
      if layout and "collectives" in s:  # What a pipeline's estimate takes from its
        t.update(collectives={"total": s["collectives"]["total"]},  # HLO (fit_stages.py).
                 dcn_collectives={"total": s["dcn_collectives"]["total"]})
      self.ledger.add(t)
      self.ledger.save(self.result(False))
      how = f"compiled in {_clock(t['compile_s'] or 0)}"
    print(f"fit [{_clock(time.perf_counter() - self.t0)}]: remat={key}, {b} x "
          f"{int(self.config.data.seq_len)} per chip: {gib(t['total'])} of "
          f"{gib(t['hbm_bytes'])} -> {'fits' if t['fits'] else 'does not fit'} ({how})",
          flush=True)
    return t["fits"], float(t["total"])

  def roofline(self, remat: str, b: int) -> dict[str, Any]:
    t = self.ledger.find(remat, b, roofline=True)
    if t is None or "estimate" not in t:  # An earlier version's, without the estimate.
      if t is not None:
        self.ledger.rooflines.remove(t)
      self.arm()
      s = self.compile_train(_with(self.config, b, remat, self.topo), self.topo, True)
      t = {"remat": remat, "per_chip": b, **ranked_estimate(s)}
      self.ledger.add(t, roofline=True)
      self.ledger.save(self.result(False))
    return {k: v for k, v in t.items() if k not in ("remat", "per_chip")}


def fit_search(config, topology: str | Topology, num_slices: int = 1,
               compile_train: Callable[..., dict] | None = None,
               ceiling: int = MAX_PER_CHIP, policies_asked: Sequence[str] | None = None,
               roofline: bool = True, out: str | None = None,
               stages: Sequence[int] = (), microbatch_factors: Sequence[int] = DEFAULT_FACTORS
               ) -> dict[str, Any]:
  """Per policy (search order of `policies`): the largest per-chip batch whose train step
  fits, its HBM per chip (and roofline estimate); `recommended` is the policy with the
  most estimated tokens/s/chip (without estimates: the most sequences per chip, then the
  least recompute), and its `flags`. `out`: the JSON, written after every trial, whose
  trials a re-run reuses. `stages` (more than 1 among them): the pipeline's stage counts
  searched too, `microbatch_factors` their microbatches M = k * S (fit_stages.py); the
  recommendation is then the fastest of all. `compile_train(config, topo, roofline) ->
  step report` is injectable (tests)."""
  topo = topology if isinstance(topology, Topology) else parse_topology(topology, num_slices)
  names = policies(policies_asked)
  ledger = Ledger.open(out, search_key(config, topo))
  if compile_train is None:
    topology_devices(topo)  # libtpu loads (and installs its signal handlers) here.
  hbm = capacity(topo)
  stop = lambda: (f"fit: stopped by SIGTERM after {len(ledger.trials)} trials; they are in "
                  f"{out}, and the same command reuses them")
  guard = exit_on_sigterm(stop) if threading.current_thread() is threading.main_thread() \
      else _no_guard()
  with guard as arm:
    search = _Search(config, topo, ledger, compile_train or _compile_train, arm, names)
    start = max(1, int(config.data.batch_size) // topo.num_chips)
    top, slope, previous = ceiling, None, None
    for remat in names:
      row: dict[str, Any] = {"remat": remat, "per_chip": None}
      if top is None:
        row["skipped"] = f"{previous} fits no sequence per chip, and {remat} keeps more"
      else:
        best, slope = largest_fitting(lambda b, r=remat: search.trial(r, b), min(start, top),
                                      top, hbm, slope)
        row["per_chip"] = best
        if best is not None:
          row.update(search.roofline(remat, best) if roofline else
                     next({"memory": t["memory"], "hbm_bytes": t["hbm_bytes"]}
                          for t in ledger.trials if (t["remat"], t["per_chip"]) == (remat, best)))
          start = best
        if remat in RECOMPUTE_ORDER:  # What the next, more-keeping policy can fit at most.
          top, previous = best, remat
      search.rows.append(row)
    result = search.result(True)
    if set(stages) - {1}:
      result = _with_stages(search, result, names, stages, microbatch_factors,
                            lambda m, b, top, sl: largest_fitting(m, b, top, hbm, sl),
                            ceiling, start)
    if topo.num_slices > 1 and "recommended" in result:
      result["across_slices"] = (
          across_slices(_as_recommended(config, result["recommended"]), topo,
                        result["recommended"],
                        lambda *a: (arm(), search.compile_train(*a))[1], _with, ledger)
          if roofline else
          {"recommended": None, "why": "the comparison needs the roofline (--roofline)"})
      result["rooflines"] = ledger.rooflines
      if result["across_slices"].get("flags"):  # The layout across slices, if another.
        result["recommended"]["flags"] += " " + result["across_slices"]["flags"]
    ledger.save(result)
  result["reused_trials"] = ledger.reused
  return result


def _with_stages(search, result, names, stages, factors, largest, ceiling, start):
  """The search's result with the pipeline candidates (`pipeline`) and the fastest of
  all recommended (fit_stages.py)."""
  refs = {r["remat"]: r for r in search.rows if r["per_chip"] is not None}
  rows = search_stages(search, names, stages, factors, refs, largest, ceiling, start)
  rec = recommend(result.get("recommended"), rows, search.topo.num_chips, search.config)
  result = {**search.result(True), "pipeline": rows, "fit_stages": sorted(set(stages)),
            "fit_microbatches": list(factors)}
  if rec is not None:
    result["recommended"], result["fits"] = rec, True
  return result


def _as_recommended(config, rec: dict):
  """The config with the recommendation's stages (the layouts across slices keep them)."""
  return pipelined(config, rec["stages"], rec["microbatches"]) if rec.get("stages", 1) > 1 \
      else config


class _no_guard:  # pylint: disable=invalid-name
  def __enter__(self):
    return lambda: None

  def __exit__(self, *exc):
    return False


def _recommend(fitting: list[dict], chips: int, config) -> dict[str, Any]:
  speed = lambda r: (r.get("tokens_per_s_estimate") or 0.0) / chips
  recompute = {p: i for i, p in enumerate(RECOMPUTE_ORDER)}
  rec = max(fitting, key=lambda r: (speed(r), r["per_chip"],
                                    -recompute.get(r["remat"], len(RECOMPUTE_ORDER))))
  flags = (f"--config.data.batch_size={rec['per_chip'] * chips} "
           f"--config.model.remat={rec['remat']}")
  if config.model.remat_custom and rec["remat"] != "custom":
    flags += " --config.model.remat_custom="  # The preset's map is for custom only.
  return {**rec, "flags": flags}


def format_fit(r: dict[str, Any]) -> str:
  trials = len(r["trials"])
  lines = [f"{r['config']} on {r['topology']} ({r['chips']} chips), sequences of "
           f"{r['seq_len']}: the largest per-chip batch whose train step fits, per remat "
           f"policy ({trials} memory-only trials, {r.get('reused_trials', 0)} of them "
           f"reused; {len(r['rooflines'])} roofline compiles; {_clock(r['seconds'])})"]
  for row in r["policies"]:
    if row["per_chip"] is None:
      why = row.get("skipped", "nothing fits, not even 1 sequence per chip")
      lines.append(f"  remat={row['remat']:<22} {why}")
      continue
    m = row["memory"]
    bound = f", {row['bound']}-bound" if row.get("bound") else ""
    time_s = (f"{row['step_time_s'] * 1e3:.3g} ms per step{bound}, "
              f"{row['tokens_per_s_estimate'] / r['chips']:,.0f} tokens/s/chip (ESTIMATE)"
              if row.get("step_time_s") else "no roofline estimate")
    lines.append(f"  remat={row['remat']:<22} {row['per_chip']:>4} x {r['seq_len']} per chip: "
                 f"{gib(m['total'])} of {gib(row['hbm_bytes'])}; {time_s}")
  lines += stage_lines(r) + slices_lines(r)
  rec = r.get("recommended")
  lines.append(f"recommended: {rec['flags']}" if rec else
               "recommended: none fits; shard the state further (--config.mesh.*) or "
               "shorten data.seq_len")
  return "\n".join(lines)

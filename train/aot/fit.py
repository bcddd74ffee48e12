"""`launch.py --mode compile --fit`: the largest per-chip batch that fits under each remat
policy, cheapest recompute first, and the `--config` flags to use (docs/compile.md).

  result = fit_search(config, "v5e-16")
  print(format_fit(result))

The search compiles the train step only and reads `memory_analysis` (no roofline's extra
compiles, no eval / decode): per policy, doubling from the config's per-chip batch while
it fits (halving while it does not), then a binary search between the last batch that
fit and the first that did not. A policy never does worse than the one before it in
RECOMPUTE_ORDER (it saves less for the backward pass), so its search starts at that
policy's batch. The batch a policy fits is then compiled once more with the roofline
(train/aot/report.py add_roofline: an ESTIMATE) for its HBM and step time.

A per-chip batch of b is data.batch_size = b * chips (every chip one share of the batch).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from typing import Any

from absl import logging

from model.config import REMAT_POLICIES
from train.aot.mode import compile_for_topology
from train.aot.report import gib
from train.aot.topology import Topology, parse_topology

# Cheapest recompute first (model/remat.py's policies by what they save), which is also
# the most device HBM first as compiled for TPU (benchmarks/remat_memory.py, v5e:2x2:
# docs/model.md, "Remat policies"): none recomputes nothing, full everything. save_dots
# keeps the float32 matmul outputs (more HBM than minimal_with_context, which recomputes
# less); an offloaded policy recomputes what its twin does and comes after it; measured,
# qkv_proj_offloaded holds as much HBM as save_qkv_proj. A named policy the project adds
# that is not listed here is tried just before full. `custom` needs a per-tensor map, so
# the search leaves it out.
RECOMPUTE_ORDER = ("none", "save_dots", "minimal_with_context", "minimal",
                   "minimal_offloaded", "save_dot_except_mlp", "save_qkv_proj",
                   "qkv_proj_offloaded", "save_out_proj", "full")
MAX_PER_CHIP = 256  # Sequences per chip: the search's ceiling.


def policies(available: Sequence[str] = REMAT_POLICIES) -> list[str]:
  """The remat policies to try, cheapest recompute first, full last."""
  rank = {p: i for i, p in enumerate(RECOMPUTE_ORDER)}
  named = [p for p in available if p != "custom"]
  return sorted(named, key=lambda p: (p == "full", rank.get(p, len(RECOMPUTE_ORDER) - 1)))


def largest_fitting(fits: Callable[[int], bool], start: int,
                    ceiling: int = MAX_PER_CHIP) -> int | None:
  """The largest b in [1, ceiling] with fits(b), assuming fits is monotone (what fits at b
  fits below it); None when even 1 does not. Each b is asked at most once."""
  if start < 1 or ceiling < 1:
    raise ValueError(f"per-chip batch search from {start} up to {ceiling}: both must be >= 1")
  seen: dict[int, bool] = {}

  def ask(b: int) -> bool:
    if b not in seen:
      seen[b] = bool(fits(b))
    return seen[b]

  b = min(start, ceiling)
  if ask(b):
    lo, hi = b, None
    while hi is None and lo < ceiling:
      nxt = min(2 * lo, ceiling)
      lo, hi = (nxt, None) if ask(nxt) else (lo, nxt)
    if hi is None:
      return lo
  else:
    hi, lo = b, None
    while lo is None and hi > 1:
      nxt = hi // 2
      hi, lo = (nxt, None) if not ask(nxt) else (hi, nxt)
    if lo is None:
      return None
  while hi - lo > 1:  # fits(lo), not fits(hi).
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if ask(mid) else (lo, mid)
  return lo


def _with(config, per_chip: int, remat: str, topo: Topology):
  c = copy.deepcopy(config)
  c.data.batch_size = per_chip * topo.num_chips
  c.eval.batch_size = per_chip * topo.num_chips
  c.model.remat = remat
  return c


def _compile_train(config, topo: Topology, roofline: bool) -> dict[str, Any]:
  return compile_for_topology(config, topo, steps=("train",), try_remat=False,
                              roofline=roofline)["steps"]["train"]


def fit_search(config, topology: str | Topology, num_slices: int = 1,
               compile_train: Callable[..., dict] | None = None,
               ceiling: int = MAX_PER_CHIP) -> dict[str, Any]:
  """Per policy (cheapest recompute first): the largest per-chip batch whose train step
  fits, its HBM per chip and roofline estimate; `recommended` is the policy with the
  most estimated tokens/s/chip (with no estimate: the most tokens per step), and its
  `flags`. `compile_train(config, topo, roofline) -> step report` is injectable (tests)."""
  topo = topology if isinstance(topology, Topology) else parse_topology(topology, num_slices)
  compile_train = compile_train or _compile_train
  t0 = time.perf_counter()
  start = max(1, int(config.data.batch_size) // topo.num_chips)
  rows, trials = [], []
  for remat in policies():
    def fits(b, remat=remat):
      s = compile_train(_with(config, b, remat, topo), topo, False)
      trials.append({"remat": remat, "per_chip": b, "fits": bool(s["fits"]),
                     "total": s["memory"]["total"], "compile_s": s.get("compile_s")})
      logging.info("fit: remat=%s, %d per chip: %s (%.2f GiB, compiled in %s s)", remat, b,
                   "fits" if s["fits"] else "does not fit", s["memory"]["total"] / 2**30,
                   s.get("compile_s"))
      return s["fits"]
    best = largest_fitting(fits, start, ceiling)
    row: dict[str, Any] = {"remat": remat, "per_chip": best}
    if best is not None:
      s = compile_train(_with(config, best, remat, topo), topo, True)
      row.update(memory=s["memory"], hbm_bytes=s["hbm_bytes"],
                 step_time_s=s.get("roofline", {}).get("step_time_s"),
                 tokens_per_s_estimate=s.get("tokens_per_s_estimate"),
                 mfu_estimate=s.get("mfu_estimate"))
      start = best
    rows.append(row)
  out = {"topology": topo.name, "chips": topo.num_chips, "config": config.name,
         "seq_len": int(config.data.seq_len), "policies": rows, "trials": trials}
  fitting = [r for r in rows if r["per_chip"] is not None]
  if fitting:
    chips = topo.num_chips
    speed = lambda r: (r["tokens_per_s_estimate"] or 0.0) / chips
    rec = max(fitting, key=lambda r: (speed(r), r["per_chip"]))
    out["recommended"] = {**rec, "flags": f"--config.data.batch_size={rec['per_chip'] * chips}"
                          f" --config.model.remat={rec['remat']}"}
  out["seconds"] = round(time.perf_counter() - t0, 1)
  return out


def format_fit(r: dict[str, Any]) -> str:
  lines = [f"{r['config']} on {r['topology']} ({r['chips']} chips), sequences of "
           f"{r['seq_len']}: the largest per-chip batch whose train step fits, per remat "
           f"policy ({len(r['trials'])} memory-only compiles, {r['seconds']:.0f} s)"]
  for row in r["policies"]:
    if row["per_chip"] is None:
      lines.append(f"  remat={row['remat']:<22} nothing fits, not even 1 sequence per chip")
      continue
    m = row["memory"]
    time_s = (f"{row['step_time_s'] * 1e3:.3g} ms per step, "
              f"{row['tokens_per_s_estimate'] / r['chips']:,.0f} tokens/s/chip (ESTIMATE)"
              if row.get("step_time_s") else "no roofline estimate")
    lines.append(f"  remat={row['remat']:<22} {row['per_chip']:>4} x {r['seq_len']} per chip: "
                 f"{gib(m['total'])} of {gib(row['hbm_bytes'])}; {time_s}")
  rec = r.get("recommended")
  lines.append(f"recommended: {rec['flags']}" if rec else
               "recommended: none fits; shard the state further (--config.mesh.*) or "
               "shorten data.seq_len")
  return "\n".join(lines)

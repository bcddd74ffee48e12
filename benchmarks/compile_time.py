"""Compile time of the train step: 4 and 32 layers, scanned (nn.scan) and unscanned.

Width and sequence of config S. Lowering (tracing to StableHLO) and XLA compilation
are timed apart; their sum is the figure. The persistent compilation cache must be
off (benchmarks/run.py turns it off), or a second run would time a cache read.
"""

from __future__ import annotations

from benchmarks import common
from benchmarks.common import Mode

LAYERS = (4, 32)
SMOKE_LAYERS = (1, 4)


def run(mode: Mode) -> dict:
  """{"layers": [...], "results": [{layers, scan, lower_s, compile_s, total_s}]}."""
  layers = SMOKE_LAYERS if mode.smoke else LAYERS
  reps = 2 if mode.name == "full" else 1
  results = []
  for scan in (True, False):
    for n in layers:
      cfg = common.model_config("S", mode, num_layers=n, scan_layers=scan, scan_unroll=1)
      batch = common.random_batch(cfg)
      best = None
      for _ in range(reps):  # A fresh jit each time; the fastest is the least disturbed.
        s = common.compile_train_step(cfg, batch, init=False)
        if best is None or s.lower_s + s.compile_s < best[0] + best[1]:
          best = (s.lower_s, s.compile_s)
      r = {"layers": n, "scan": scan, "lower_s": best[0], "compile_s": best[1],
           "total_s": sum(best)}
      results.append(r)
      print(f"compile {n} layers {'scanned' if scan else 'unscanned'}: lower "
            f"{r['lower_s']:.1f} s + compile {r['compile_s']:.1f} s", flush=True)
  return {"config": "S", "layers": list(layers), "results": results}


def total(compile_result: dict, layers: int, scan: bool) -> float:
  for r in compile_result["results"]:
    if (r["layers"], r["scan"]) == (layers, scan):
      return r["total_s"]
  raise KeyError(f"no compile result for {layers} layers, scan={scan}")

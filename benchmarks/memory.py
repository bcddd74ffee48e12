"""Peak memory of a train step at M, from the compiled executable's memory analysis.

Per remat policy (cfg.remat: "none", "full", "save_dots"). XLA reports argument,
output, alias (outputs written in place of donated arguments) and temporary bytes;
the temporaries are the step's buffer assignment after reuse, so

    peak = arguments + outputs - aliases + temporaries

is the memory the step holds at its high-water mark (at most: it counts every
temporary as live at once). XLA:CPU's own `peak_memory_in_bytes` is recorded as
`xla_peak_bytes`, but on CPU it equals the argument bytes, so it is not used.
"""

from __future__ import annotations

from benchmarks import common
from benchmarks.common import Mode

POLICIES = ("none", "full", "save_dots")
FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
          "temp_size_in_bytes", "generated_code_size_in_bytes")


def analyse(compiled) -> dict:
  stats = compiled.memory_analysis()
  out = {f.replace("_size_in_bytes", "_bytes"): int(getattr(stats, f, 0) or 0) for f in FIELDS}
  xla_peak = int(getattr(stats, "peak_memory_in_bytes", 0) or 0)
  out.update(xla_peak_bytes=xla_peak, peak_bytes=out["argument_bytes"] + out["output_bytes"] -
             out["alias_bytes"] + out["temp_bytes"])
  return out


def run(mode: Mode) -> dict:
  """{"config": "M", "results": {policy: analyse(...)}} for float32 at M, batch 8."""
  results = {}
  for policy in POLICIES:
    # Remat inside the layer loop (scan_unroll=1): unrolled, XLA:CPU schedules the
    # recomputation early and the saving is lost (docs/model.md, "The layer stack").
    cfg = common.model_config("M", mode, remat=policy, scan_unroll=1)
    step = common.compile_train_step(cfg, common.random_batch(cfg), init=False)
    results[policy] = analyse(step.compiled)
    print(f"memory M remat={policy}: peak {results[policy]['peak_bytes'] / 2**20:.0f} MiB, "
          f"temporaries {results[policy]['temp_bytes'] / 2**20:.0f} MiB", flush=True)
  return {"config": "M", "dtype": "float32", "results": results}

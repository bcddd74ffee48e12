"""Ahead-of-time compilation for TPU topologies that are not attached (docs/compile.md).

  report = compile_for_topology(config, "v5p:4x4x4")    # train, eval, decode steps
  print(format_report(report))

`launch.py --mode compile --config ... --topology v5p:4x4x4` is this, plus a JSON file.

  mode.py      compile_for_topology, format_report: the steps compiled, the verdict
  compile.py   each step lowered and compiled against the topology's devices
  fit.py       --fit: the largest per-chip batch that fits, per remat policy
  fit_ledger.py  its trials in the JSON after each one (a re-run reuses them), SIGTERM
  topology.py  TPU topologies by name; report.py, hlo.py: memory, roofline, collectives
"""

from train.aot.mode import STEPS, compile_for_topology, format_report
from train.aot.topology import CHIPS, Topology, libtpu_available, parse_topology

__all__ = ["CHIPS", "STEPS", "Topology", "compile_for_topology", "format_report",
           "libtpu_available", "parse_topology"]

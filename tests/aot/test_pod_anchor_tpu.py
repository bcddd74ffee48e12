"""The pod table's 405b row, recompiled: its recorded command still fits, at its figure.

docs/PERFORMANCE.md's anchor rows are libtpu's compiled memory for the commands that
benchmarks/pod_large/*.json record. Nothing else pins them: a rules change once added
6 GiB to 405b's temporaries and passed every other tier. This test reruns the 405b
row's recorded command (train step only, no roofline: about 2 min on 2 cores) and holds
its per-chip total to the recorded one, both ways: more is a regression, less means
the table and its JSON are stale (regenerate them with the command in the JSON).
The 70b and dsv3 rows do not fit, so each would compile its remat=full twin as well;
they are left to the regeneration commands in docs/PERFORMANCE.md.
"""

import json
import os

import pytest

from tests.cli import ROOT, launch
from train.aot import libtpu_available

pytestmark = [pytest.mark.aot, pytest.mark.skipif(
    not libtpu_available(), reason="libtpu is not installed: make test-aot")]
LEDGER = os.path.join(ROOT, "benchmarks", "pod_large", "405b-v6e-256x2.json")
TOLERANCE_GIB = 0.1  # The compile is deterministic for the pinned libtpu.


def _recorded_args(command: list[str]) -> list[str]:
  """The recorded command line without the program and its --out."""
  args = list(command[1:])
  if "--out" in args:
    i = args.index("--out")
    del args[i:i + 2]
  return args


def test_the_405b_row_recompiles_to_its_recorded_memory(tmp_path):
  with open(LEDGER, encoding="utf-8") as f:
    recorded = json.load(f)
  out = tmp_path / "405b.json"
  printed = launch(*_recorded_args(recorded["command"]), "--noroofline", "--out", str(out))
  now = json.loads(out.read_text())
  assert now["fits"], printed
  assert now["mesh"] == recorded["mesh"] and now["params"] == recorded["params"]
  gib = {k: r["steps"]["train"]["memory"]["total"] / 2**30
         for k, r in (("recorded", recorded), ("now", now))}
  assert abs(gib["now"] - gib["recorded"]) <= TOLERANCE_GIB, (
      f"405b compiles to {gib['now']:.2f} GiB per chip; {LEDGER} records "
      f"{gib['recorded']:.2f}. A rise is a memory regression; a fall means the pod table "
      "is stale: rerun the JSON's command and update docs/PERFORMANCE.md.")

"""`launch.py --mode compile --fit --fit_stages=1,2` on a tiny config for v5e:2x2 (libtpu;
the aot tier): the pipelined candidates are compiled (mesh.stage=2 at M = 2 and 4), each
fits by memory_analysis, gets an ESTIMATE through GPipe's bubble, and the report names
the choice; the recommended flags compile and fit. Few compiles: one policy, at most 2
sequences per chip.
"""

import json

import pytest

from tests.cli import launch
from train.aot import libtpu_available

pytestmark = [pytest.mark.aot, pytest.mark.skipif(
    not libtpu_available(), reason="libtpu is not installed: make test-aot")]
BASE = ("--mode", "compile", "--config", "experiments/configs/pod.py:preset=1b,smoke",
        "--topology", "v5e:2x2", "--config.data.batch_size=8")


def test_fit_searches_stages_and_its_recommendation_compiles(tmp_path):
  out = tmp_path / "fit.json"
  printed = launch(*BASE, "--fit", "--fit_policies=full", "--fit_max_per_chip=2",
                   "--fit_stages=1,2,4", "--fit_microbatches=1,2", "--out", str(out))
  r = json.loads(out.read_text())
  rows = {(row["stages"], row.get("microbatches")): row for row in r["pipeline"]}
  assert "must divide into 4 equal" in rows[4, None]["refused"]
  for M in (2, 4):
    row = rows[2, M]
    assert row["per_chip"] == 2 and row["memory"]["total"] <= row["hbm_bytes"]
    est = row["estimate"]
    assert est["bubble"] == pytest.approx(1 / (M + 1))
    assert est["compute_s"] > 0 and est["ici_s"] > 0  # Its own stage transfers.
  # More microbatches, a smaller bubble: the compute term shrinks with (M + S - 1) / M.
  assert rows[2, 4]["estimate"]["compute_s"] == pytest.approx(
      rows[2, 2]["estimate"]["compute_s"] * (5 / 4) / (3 / 2))
  rec = r["recommended"]
  assert f"pipeline choice: {rec['why']}" in printed
  assert printed.strip().splitlines()[-2] == f"recommended: {rec['flags']}"
  flags = rec["flags"].split()
  again = launch(*BASE, *flags, "--noroofline", "--compile_steps", "train",
                 "--out", str(tmp_path / "rec.json"))
  assert json.loads((tmp_path / "rec.json").read_text())["fits"], again

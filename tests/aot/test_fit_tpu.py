"""`launch.py --mode compile --fit` on a tiny config for v5e:2x2 (libtpu; the aot tier).

Properties: every policy reports a fitting per-chip batch (the smoke model fits at the
ceiling), against the one v5e capacity (15.75 GiB), with a roofline estimate; the last
line is the recommended flags and they name a policy that was tried.
"""

import json

import pytest

from tests.cli import launch
from train.aot import libtpu_available

pytestmark = [pytest.mark.aot, pytest.mark.skipif(
    not libtpu_available(), reason="libtpu is not installed: make test-aot")]


def test_fit_search_prints_each_policy_and_the_flags_to_use(tmp_path):
  out = tmp_path / "fit.json"
  printed = launch("--mode", "compile", "--fit", "--fit_max_per_chip=2", "--config",
                   "experiments/configs/pod.py:preset=1b,smoke", "--topology", "v5e:2x2",
                   "--config.mesh.data=2", "--config.mesh.fsdp=2", "--out", str(out))
  r = json.loads(out.read_text())
  assert [row["remat"] for row in r["policies"]][0] == "none"
  assert r["policies"][-1]["remat"] == "full"
  for row in r["policies"]:
    assert row["per_chip"] == 2, row
    assert row["hbm_bytes"] == int(15.75 * 2**30)
    assert 0 < row["memory"]["total"] < row["hbm_bytes"] and row["step_time_s"] > 0
  rec = r["recommended"]
  assert printed.strip().splitlines()[-2] == f"recommended: {rec['flags']}"
  assert rec["flags"] == f"--config.data.batch_size=8 --config.model.remat={rec['remat']}"
  assert all(t["fits"] for t in r["trials"]) and len(r["trials"]) == len(r["policies"])

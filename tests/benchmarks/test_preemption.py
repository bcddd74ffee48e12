"""benchmarks/preemption.py at smoke size: a bucket run (moto's S3 server) killed once and
restarted, with and without the local tier; its figures come from the goodput ledger,
which sums to its own wall time and stays within the harness's measured wall."""

import json
import math
import os

import pytest

from benchmarks import preemption
from tests.cli import SMOKE


def test_a_killed_bucket_run_reports_its_goodput_within_the_measured_wall(tmp_path):
  pytest.importorskip("s3fs")
  pytest.importorskip("moto.server")
  out = tmp_path / "preemption.json"
  preemption.main(["--config", SMOKE, "--steps", "8", "--checkpoint_every", "4",
                   "--local_every", "2", "--kill_every", "1", "--max_kills", "1",
                   "--out", str(out)])
  result = json.loads(out.read_text())
  for name in ("persistent_only", "with_local_tier"):
    r = result[name]
    assert r["kills"] == 1 and r["attempts"] == 2, r
    assert math.isclose(r["breakdown_sum_s"], r["ledger_wall_s"], rel_tol=1e-6)
    assert r["ledger_wall_s"] <= r["measured_wall_s"], r  # The last exit is outside it.
    assert -15 < r["sum_vs_measured_pct"] <= 0, r
    assert 0 < r["goodput"] < 1 and r["steps"]["productive"] == 8, r
    assert r["seconds"]["between"] > 0 and r["seconds"]["compile"] > 0, r
  assert os.path.isfile(out)

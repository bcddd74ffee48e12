"""`launch.py --sweep` with a bucket root (moto's S3 server and the local GCS server,
fixture `bucket`): points train into the bucket, a failing point's FAILED lands there and
the sweep exits 1, an evaluation point is written there, and the report of the root reads
them all."""

import os

import pytest

from experiments import report
from tests.cli import launch
from tests.experiments.test_sweep import CONFIG, STEPS
from train.io import storage
from train.metrics import read_metrics


def test_a_sweep_into_a_bucket_trains_records_failures_and_reports(bucket, tmp_path):
  config = tmp_path / "two_points.py"
  config.write_text(CONFIG.replace('if arg == "bad":', 'if arg in ("bad", "evals"):'))
  (tmp_path / "empty.txt").write_text("abc\n")
  root = storage.join(bucket, "sweep")
  with pytest.raises(SystemExit) as e:
    launch("--config", f"{config}:evals", "--workdir", root, "--sweep", *STEPS)
  assert e.value.code == 1  # The bad point failed.
  out = e.value.stdout
  assert "bad" in out and f"{root}/bad/FAILED" in out
  assert "window" in storage.read_text(storage.join(root, "bad", "FAILED"))  # Its error.
  for name in ("pairs2", "pairs4"):
    assert [r["step"] for r in read_metrics(storage.join(root, name))
            if r["split"] == "eval"] == [2]
  evaluated = read_metrics(storage.join(root, "pairs2-at2L"))
  assert [r["step"] for r in evaluated] == [2]
  assert storage.exists(storage.join(root, "sweep.json"))
  written = report.write_report(root)
  rows = {r["run"]: r for r in report.load_results(root).to_dict("records")}
  assert rows["bad"]["status"] == "failed" and rows["pairs4"]["status"] == "finished"
  assert written["markdown"] == f"{root}/report/table.md"
  assert "pairs2" in storage.read_text(written["markdown"])
  assert not os.path.exists(bucket.split("//")[0])

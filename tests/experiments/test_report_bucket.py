"""`python -m experiments.report s3://...`: a sweep root on a bucket (moto's S3 server and
the local GCS server, fixture `bucket`) reports exactly what the same runs report from a
local directory, and the report's files land in the bucket."""

import os

from experiments import report
from tests.experiments.test_report import FINAL, ORDER, _write_run
from train.io import runlog, storage
from train.metrics import METRICS_FILE


def _mirror(local_root: str, url: str) -> None:
  """The local sweep's files on the bucket, each log as a trainer writes one there."""
  for here, _, files in os.walk(local_root):
    for name in files:
      path = os.path.join(here, name)
      rel = os.path.relpath(path, local_root).split(os.sep)
      with open(path, encoding="utf-8") as f:
        text = f.read()
      if name == METRICS_FILE:  # Two segments, as two syncs write them.
        lines = text.splitlines(keepends=True)
        run = storage.join(url, *rel[:-1])
        runlog.append(run, METRICS_FILE, lines[:2])
        runlog.append(run, METRICS_FILE, lines[2:])
      else:
        storage.write_text(storage.join(url, *rel), text)


def test_a_bucket_sweep_root_reports_what_a_local_one_does(bucket, tmp_path, capsys):
  local = tmp_path / "gqa"
  for (kv, seed), loss in FINAL.items():
    _write_run(local / f"kv{kv}-s{seed}", kv, seed, loss)
  _write_run(local / "kv1-s0", 1, 0, 1.0, finished=False)
  (local / "kv8-s0").mkdir()
  (local / "kv8-s0" / "FAILED").write_text("Traceback ...\nValueError: boom")
  (local / "sweep.json").write_text('{"points": [' + ", ".join(
      f'{{"name": "{n}"}}' for n in ORDER) + "]}")
  root = storage.join(bucket, "gqa")
  _mirror(str(local), root)
  expected = report.write_report(str(local), str(tmp_path / "out"))
  report.main([root])  # The command line: python -m experiments.report s3://...
  printed = capsys.readouterr().out
  assert f"{root}/report/table.md" in printed
  for kind in ("results", "summary", "markdown", "latex"):
    name = os.path.basename(expected[kind])
    with open(expected[kind], "rb") as f:
      assert storage.read_bytes(storage.join(root, "report", name)) == f.read(), name
  plots = [k for k in expected if k.endswith("_plot")]
  assert plots and all(storage.exists(storage.join(root, "report", os.path.basename(
      expected[k]))) for k in plots)
  assert report.load_results(root).equals(report.load_results(str(local)))

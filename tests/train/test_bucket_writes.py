"""The modes of launch.py that write a new run or a report into a bucket (moto's S3 and the
local GCS server, fixture `bucket`): `--mode import` of a tiny Hugging Face model and
`--mode convert` into the bucket (checkpoints through orbax / TensorStore, with their
CHECKSUMS.json), each refusing a workdir that already holds a run, a decay branch of a
sweep with a bucket root (slow tier), `--mode compile --out s3://...` (the report's
writer, the compile stubbed), and a `train.profile_steps` trace of a bucket run."""

import json
import os
import re

import jax
import numpy as np
import pytest

from interop import export_hf_dir
from model import ModelConfig
from tests.cli import launch
from tests.interop.test_hf_weights import init
from train import load_run
from train.io import checksums, storage
from train.lifecycle.config_record import contents
from train.metrics import read_metrics

CFG = ModelConfig(vocab_size=256, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  mlp_dim=48, max_seq_len=32)


def _objects(url):
  return {rel: storage.read_bytes(storage.join(url, rel)) for rel in storage.files(url)}


def test_import_and_convert_into_a_bucket_refuse_a_run_already_there(bucket, tmp_path):
  params, state = init(CFG)
  hf_dir = export_hf_dir((CFG, {"params": params, **state}), str(tmp_path / "tiny"))
  run = storage.join(bucket, "hf")
  assert "imported" in launch("--mode", "import", "--hf_dir", hf_dir, "--workdir", run)
  assert contents(run) == ["config.json", "checkpoints at steps [0]"]
  step = storage.join(run, "checkpoints", "0")
  assert storage.exists(storage.join(step, checksums.CHECKSUMS_FILE))
  checksums.verify(storage.join(run, "checkpoints"), 0)  # Sealed as saved.
  imported = load_run(run)
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(imported.variables["params"]),
                                                  jax.tree.leaves(params)))
  before = _objects(run)
  with pytest.raises(FileExistsError, match=f"{run} already holds a run"):
    launch("--mode", "import", "--hf_dir", hf_dir, "--workdir", run)

  dst = storage.join(bucket, "mqa")
  out = launch("--mode", "convert", "--from_run", run, "--workdir", dst,
               "--config.model.num_kv_heads=1")
  assert f"into {dst}" in out
  checksums.verify(storage.join(dst, "checkpoints"), 0)
  converted = load_run(dst)
  assert converted.model_config.num_kv_heads == 1 and converted.step == 0
  assert json.loads(storage.read_text(storage.join(dst, "config.json")))["_run"][
      "converted_from"] == run
  with pytest.raises(FileExistsError, match=f"{dst} already holds a run"):
    launch("--mode", "convert", "--from_run", run, "--workdir", dst,
           "--config.model.num_kv_heads=1")
  assert _objects(run) == before  # The refusals and the conversion left the source as it was.
  assert not os.path.exists(bucket.split("//")[0])  # No local stand-in named after the URL.


BRANCH_CONFIG = '''
from experiments.configs import tiny

def get_config(arg=None):
  c = tiny.get_config("smoke")
  c.train.update(schedule="wsd", decay_fraction=0.25, steps=8, warmup_steps=2, log_every=1,
                 eval_every=4, async_checkpoint=False, tensorboard=False)
  return c

def sweep(arg=None):
  return [{"name": "trunk"}, {"name": "b4", "branch_of": "trunk", "train.steps": 4}]
'''


def test_a_sweep_branch_into_a_bucket_copies_the_step_with_its_checksums(bucket, tmp_path):
  config = tmp_path / "wsd_sweep.py"
  config.write_text(BRANCH_CONFIG)
  root = storage.join(bucket, "sweep")
  out = launch("--config", str(config), "--workdir", root, "--sweep")
  assert re.search(r"^b4 +done$", out, re.M), out
  trunk, branch = storage.join(root, "trunk"), storage.join(root, "b4")
  record = json.loads(storage.read_text(storage.join(branch, "config.json")))
  assert record["_run"] == {**record["_run"], "branched_from": trunk, "source_step": 3}
  copied = storage.join(branch, "checkpoints", "3")
  assert _objects(copied) == _objects(storage.join(trunk, "checkpoints", "3"))  # Byte for byte.
  checksums.verify(storage.join(branch, "checkpoints"), 3)
  assert [r["step"] for r in load_run(branch).metrics if r["split"] == "train"] == [4]
  again = launch("--config", str(config), "--workdir", root, "--sweep")
  assert re.search(r"^b4 +skipped$", again, re.M), again


def test_a_branch_copy_cut_short_on_a_bucket_is_refused_by_name(bucket):
  from train.branch import branch_run  # pylint: disable=g-import-not-at-top
  from experiments.configs import tiny  # pylint: disable=g-import-not-at-top
  dst = storage.join(bucket, "b4")
  storage.write_bytes(storage.join(dst, "checkpoints", "3", "state", "x"), b"part")
  with pytest.raises(FileExistsError, match="no config.json, as a branch's copy cut short"):
    branch_run(storage.join(bucket, "trunk"), dst, tiny.get_config("smoke"))
  assert storage.files(dst) == {"checkpoints/3/state/x": 4}  # Left as it was.


def test_compile_writes_its_report_into_a_bucket(bucket, monkeypatch):
  import train.aot  # pylint: disable=g-import-not-at-top
  report = {"topology": "v5e:2x2", "fits": True, "steps": {"train": {"fits": True}}}
  monkeypatch.setattr(train.aot, "libtpu_available", lambda: True)
  monkeypatch.setattr(train.aot, "compile_for_topology", lambda *a, **k: dict(report))
  monkeypatch.setattr(train.aot, "format_report", lambda r: "stub report")
  out = storage.join(bucket, "compile", "report.json")
  printed = launch("--mode", "compile", "--topology", "v5e:2x2", "--out", out)
  assert f"figures in {out}" in printed
  assert json.loads(storage.read_text(out)) == report
  assert not os.path.exists(bucket.split("//")[0])


def test_profile_steps_write_the_trace_into_a_bucket_run(bucket):
  run = storage.join(bucket, "run")
  launch("--workdir", run, "--config.train.steps=2", "--config.train.profile_steps=1",
         "--config.train.profile_start=2", "--config.train.tensorboard=False")
  traces = [rel for rel in storage.files(storage.join(run, "profile"))
            if rel.endswith(".xplane.pb")]
  assert traces, "no jax.profiler trace in RUN/profile"
  assert not os.path.exists(bucket.split("//")[0])


def test_a_parallel_sweep_into_a_bucket_uploads_each_points_log(bucket, tmp_path):
  """`--sweep_parallel=2` with a bucket root: the points train into the bucket in their
  own processes, each one's sweep.log is uploaded beside its run, and a failed point's
  FAILED (with its log's tail) lands there too."""
  from tests.experiments.test_sweep import CONFIG, STEPS  # pylint: disable=g-import-not-at-top
  config = tmp_path / "points.py"
  config.write_text(CONFIG)
  (tmp_path / "empty.txt").write_text("abc\n")
  root = storage.join(bucket, "sweep")
  with pytest.raises(SystemExit) as e:
    launch("--config", f"{config}:bad", "--workdir", root, "--sweep", "--sweep_parallel=2",
           "--sweep_only=pairs2,bad", *STEPS)
  assert e.value.code == 1  # The bad point failed.
  assert [r["step"] for r in read_metrics(storage.join(root, "pairs2"))
          if r["split"] == "eval"] == [2]
  assert "eval loss" in storage.read_text(storage.join(root, "pairs2", "sweep.log"))
  failed = storage.read_text(storage.join(root, "bad", "FAILED"))
  assert "exit code: 1" in failed and "last lines of sweep.log" in failed
  assert storage.exists(storage.join(root, "bad", "sweep.log"))
  assert not os.path.exists(bucket.split("//")[0])

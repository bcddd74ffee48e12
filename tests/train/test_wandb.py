"""Weights & Biases logging (train.wandb_project), offline: no network, no account.

W&B is an optional extra: these tests run where it is installed and are skipped
elsewhere, except the error for a project asked for without the package.
"""

import glob
import importlib.util
import json
import os
import struct
import time
from unittest import mock

import pytest

from tests.cli import launch
from train.metrics import WANDB_ID_FILE, MetricsWriter


def _records(run_dir):
  """Every record W&B wrote offline under `run_dir`/wandb, as (kind, record), in order.

  The .wandb file is a LevelDB-style log (a 7-byte header, 32 KiB blocks of records
  with 7-byte headers, type 1 full / 2 first / 3 middle / 4 last) of Record protos.
  """
  from wandb.proto import wandb_internal_pb2  # pylint: disable=g-import-not-at-top
  out = []
  for path in sorted(glob.glob(os.path.join(run_dir, "wandb", "*run-*", "run-*.wandb"))):
    with open(path, "rb") as f:
      data = f.read()
    assert data[:4] == b":W&B", path
    at, block, parts = 7, 32768, b""
    while at + 7 <= len(data):
      if block - at % block < 7:  # Too little room for a header: padding.
        at += block - at % block
        continue
      _, length, kind = struct.unpack("<IHB", data[at:at + 7])
      if kind == 0:
        break
      parts += data[at + 7:at + 7 + length]
      at += 7 + length
      if kind in (1, 4):
        record = wandb_internal_pb2.Record.FromString(parts)
        parts = b""
        out.append((record.WhichOneof("record_type"), record))
  return out


def _finished_records(run_dir, runs, timeout=60):
  """_records once `runs` runs have ended (W&B's service may still be writing the last
  one's file when `finish` returns)."""
  deadline = time.time() + timeout
  while True:
    records = _records(run_dir)
    if sum(k == "exit" for k, _ in records) >= runs or time.time() > deadline:
      return records
    time.sleep(0.2)


def _history(run_dir):
  rows = []
  for kind, record in _records(run_dir):
    if kind == "history":
      rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                   for i in record.history.item})
  return rows


def test_offline_run_logs_config_and_metrics_and_a_resume_continues_it(tmp_path, monkeypatch):
  pytest.importorskip("wandb")
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  run = tmp_path / "run"
  launch("--workdir", str(run), "--config.train.steps=2", "--config.train.log_every=1",
         "--config.train.eval_every=2", "--config.hardware.peak_flops=1e12",
         "--config.train.wandb_project=blockwork-test")
  with open(run / WANDB_ID_FILE) as f:
    run_id = f.read().strip()
  runs = [r for k, r in _finished_records(str(run), runs=1) if k == "run"]
  assert [(r.run.run_id, r.run.project) for r in runs] == [(run_id, "blockwork-test")]
  config = {i.key: json.loads(i.value_json) for i in runs[0].run.config.update}
  assert config["train"]["wandb_project"] == "blockwork-test" and config["train"]["steps"] == 2
  assert "_run" in config  # The resolved config as config.json holds it.
  history = _history(str(run))
  assert [h["step"] for h in history if "train/loss" in h] == [1, 2]
  assert [h["step"] for h in history if "eval/loss" in h] == [2]
  assert all(h["train/loss"] > 0 for h in history if "train/loss" in h)
  with open(run / "config.json") as f:
    assert run_id not in f.read()  # The id lives beside config.json, never in it.

  # A resume (the loop opens a new writer) continues the same W&B run, by its id.
  writer = MetricsWriter(str(run), enabled=True, tensorboard=False,
                         wandb_project="blockwork-test")
  writer.write({"step": 3, "split": "train", "loss": 1.5, "moe_bias/layer0": [0.1, -0.1]})
  writer.close()
  assert open(run / WANDB_ID_FILE).read().strip() == run_id
  records = _finished_records(str(run), runs=2)
  assert {r.run.run_id for k, r in records if k == "run"} == {run_id}
  resumed = _history(str(run))[-1]
  assert resumed["step"] == 3 and resumed["train/moe_bias/layer0/_type"] == "histogram"


def test_project_without_the_package_fails_before_the_run_directory(tmp_path):
  real = importlib.util.find_spec
  missing = lambda name, *a: None if name == "wandb" else real(name, *a)
  with mock.patch("importlib.util.find_spec", missing):
    with pytest.raises(ValueError, match=r"config.train.wandb_project=.*pip install"):
      launch("--workdir", str(tmp_path / "run"), "--config.train.wandb_project=blockwork-test")
  assert not os.path.exists(tmp_path / "run")

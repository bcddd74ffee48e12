"""The local checkpoint tier (train/local_checkpoint.py) through launch.py: a run killed
after a local save resumes from it, bitwise an uninterrupted run's; on new hosts (no
local directory) it falls back to the run directory's checkpoints (or step 0); a local
directory is never another run's; locally and in a bucket (moto's S3 server and the local GCS server, fixture `bucket`)."""

import glob
import json
import logging
import os
import shutil
import signal
import subprocess
import time

import jax
import numpy as np
import pytest

from tests.cli import launch
from tests.train.test_loop import DETERMINISTIC, launch_cmd, params_of, smoke, train_lines
from train import checkpoint, local_checkpoint, loop
from train.io import runlog, storage
from train.io.checksums import CHECKSUMS_FILE
from train.metrics import REWOUND_FILE


def _reference(path, steps):
  loop.run(smoke(**{"train.steps": steps, "train.log_every": 1,
                    "train.checkpoint_every": 1000}), str(path))
  return path


def _same_run(run, ref):
  got, want = train_lines(run), train_lines(ref)
  assert [r["step"] for r in got] == [r["step"] for r in want]  # None lost, none twice.
  for g, w in zip(got, want):
    assert {k: g[k] for k in DETERMINISTIC} == {k: w[k] for k in DETERMINISTIC}
  for a, b in zip(jax.tree.leaves(params_of(run)), jax.tree.leaves(params_of(ref))):
    np.testing.assert_array_equal(a, b)


def _local_steps(local_root):
  """Sealed (CHECKSUMS.json written: final) local steps under `local_root`."""
  found = glob.glob(os.path.join(local_root, "*", "checkpoints", "*", CHECKSUMS_FILE))
  return sorted(int(p.split(os.sep)[-2]) for p in found)


def _persistent_steps(run):
  where = checkpoint.checkpoint_dir(run)
  if not storage.exists(where) and not storage.is_url(where):
    return []
  return sorted(int(s) for s in storage.listdir(where)
                if s.isdigit() and storage.exists(f"{where}/{s}/{CHECKSUMS_FILE}"))


def _flip_largest_object(step_dir) -> str:
  """Flips a byte of the step's largest array file; its relative path."""
  found = storage.files(step_dir)
  name = max((k for k in found if "/d/" in k), key=found.get)
  path = os.path.join(step_dir, name)
  blob = bytearray(open(path, "rb").read())
  blob[len(blob) // 2] ^= 0xFF
  open(path, "wb").write(bytes(blob))
  return name


def _kill_when(run, ready, flags, timeout=240):
  """Trains `run` in a subprocess and SIGKILLs it as soon as `ready()` holds."""
  proc = subprocess.Popen(launch_cmd(run, *flags), stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  deadline = time.time() + timeout
  try:
    while not ready():
      assert proc.poll() is None, f"training exited early with {proc.returncode}"
      assert time.time() < deadline, "not ready within the timeout"
      time.sleep(0.02)
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"


def _rewound(run):
  return [r["step"] for r in runlog.read_records(run, REWOUND_FILE) if r["split"] == "train"]


def test_local_saves_keep_the_newest_two_name_their_run_and_are_not_committed_saves(
    tmp_path):
  """5 steps, local saves every step but the last (a persistent one): the local tier
  keeps steps 3 and 4, sealed, in a directory naming this run; only step 5 is recorded
  as a committed save of the run."""
  run, local = str(tmp_path / "run"), str(tmp_path / "local")
  loop.run(smoke(**{"train.steps": 5, "train.checkpoint_every": 1000,
                    "train.local_checkpoint_every": 1, "train.local_checkpoint_dir": local}),
           run)
  assert _local_steps(local) == [3, 4] and checkpoint.recorded_saves(run) == [5]
  run_id = json.load(open(os.path.join(run, "config.json")))["_run"][local_checkpoint.RUN_ID]
  (where,) = glob.glob(os.path.join(local, "*"))
  assert where.endswith(f"-{run_id}")
  assert json.load(open(os.path.join(where, local_checkpoint.MARKER))) == {
      "workdir": os.path.abspath(run), local_checkpoint.RUN_ID: run_id}


def test_a_negative_local_interval_is_refused_before_compiling(tmp_path):
  with pytest.raises(ValueError, match="train.local_checkpoint_every"):
    loop.run(smoke(**{"train.local_checkpoint_every": -1}), str(tmp_path))
  assert not os.path.exists(os.path.join(tmp_path, "checkpoints"))


def test_killed_after_a_local_save_resumes_from_it_and_new_hosts_from_step_0(
    tmp_path, caplog):
  """40 steps, the only persistent save at 40, local saves every 2 steps: killed after a
  local save. A copy of the run directory (another URL: no local checkpoints of its own,
  as on new hosts) restarts from step 0. With its newest local step damaged, the same
  command finds it by its checksum, deletes it and resumes from the local step before
  (no save ever committed, yet nothing is redone from 0). Both end bitwise equal to an
  uninterrupted run."""
  run, local = str(tmp_path / "run"), str(tmp_path / "local")
  flags = ("--config.train.steps=40", "--config.train.log_every=1",
           "--config.train.checkpoint_every=1000", "--config.train.local_checkpoint_every=2",
           f"--config.train.local_checkpoint_dir={local}")
  _kill_when(run, lambda: any(s >= 4 for s in _local_steps(local)), flags)
  assert _persistent_steps(run) == [] and checkpoint.recorded_saves(run) == []
  newest = _local_steps(local)[-1]
  copy = str(tmp_path / "copy")
  shutil.copytree(run, copy)
  ref = _reference(tmp_path / "reference", 40)

  launch("--workdir", copy, "--config.train.async_checkpoint=False",
         "--config.train.tensorboard=False", *flags)
  assert "restarting from step 0" in caplog.text
  _same_run(copy, ref)

  caplog.clear()
  run_id = json.load(open(os.path.join(run, "config.json")))["_run"][local_checkpoint.RUN_ID]
  where = local_checkpoint.directory(smoke(**{"train.local_checkpoint_dir": local}).train,
                                     run, run_id)
  damaged = _flip_largest_object(os.path.join(where, "checkpoints", str(newest)))
  launch("--workdir", run, "--config.train.async_checkpoint=False",
         "--config.train.tensorboard=False", *flags)
  assert f"{damaged} differs from the checksum" in caplog.text  # Deleted, the one before:
  assert f"checkpoints/{newest - 2} is newer than the run directory's latest (None)" in (
      caplog.text)
  assert all(s > newest - 2 for s in _rewound(run))
  _same_run(run, ref)
  assert checkpoint.recorded_saves(run) == [40]  # Local saves are never recorded.
  record = json.load(open(os.path.join(run, "config.json")))
  assert record["_run"][local_checkpoint.RUN_ID] == json.load(
      open(os.path.join(copy, "config.json")))["_run"][local_checkpoint.RUN_ID]
  assert len(_local_steps(local)) <= 2 * local_checkpoint.KEEP  # Newest KEEP per run.


def test_a_bucket_run_resumes_from_the_newer_tier_and_on_new_hosts_from_the_bucket(
    bucket, tmp_path, caplog):
  """A bucket run with persistent saves every 10 steps and local ones every 3, killed
  after a local save newer than its latest persistent one, resumes from the local step.
  A copy of it in the bucket (another URL: no local checkpoints of its own, as on new
  hosts) resumes from the bucket's latest step. Both end bitwise equal to an
  uninterrupted run."""
  caplog.set_level(logging.INFO, logger="train.lifecycle.resume")
  run, local = f"{bucket}/run", str(tmp_path / "local")
  flags = ("--config.train.steps=40", "--config.train.log_every=1",
           "--config.train.checkpoint_every=10", "--config.train.local_checkpoint_every=3",
           f"--config.train.local_checkpoint_dir={local}")
  _kill_when(run, lambda: any(s > 10 for s in _local_steps(local))
             and 10 in _persistent_steps(run), flags)
  persistent, newest = _persistent_steps(run)[-1], _local_steps(local)[-1]
  assert newest > persistent, "the run reached its next persistent save before the kill"
  copy = f"{bucket}/copy"
  storage.copy_tree(run, copy)
  ref = _reference(tmp_path / "reference", 40)
  again = ("--config.train.async_checkpoint=False", "--config.train.tensorboard=False", *flags)

  launch("--workdir", copy, *again)
  assert "no local checkpoints in" in caplog.text
  assert f"resuming {copy} from step {persistent}" in caplog.text
  _same_run(copy, ref)

  caplog.clear()
  launch("--workdir", run, *again)
  assert (f"checkpoints/{newest} is newer than the run directory's latest ({persistent})"
          in caplog.text)
  assert all(s > newest for s in _rewound(run))
  _same_run(run, ref)
  assert sorted(set(checkpoint.recorded_saves(run))) == [10, 20, 30, 40]  # Not local ones.


@pytest.mark.multihost
def test_two_processes_leave_the_local_tier_off_and_say_why(tmp_path):
  """Two `jax.distributed` processes (tests/parallel/two_processes.py) resume a
  one-process run that saved local steps: each says the tier is off (its disk would
  hold only its shards) and writes no local step; the persistent ones carry the run."""
  from tests.parallel import two_processes  # pylint: disable=g-import-not-at-top
  run, local = tmp_path / "run", str(tmp_path / "local")
  overrides = {"train.steps": 4, "train.log_every": 1, "train.checkpoint_every": 2,
               "train.local_checkpoint_every": 1, "train.local_checkpoint_dir": local,
               "eval.batches": 1, "mesh.data": 1, "mesh.fsdp": -1, "mesh.tensor": 1,
               "mesh.expert": 1}
  loop.run(smoke(**{**overrides, "train.steps": 2}), str(run))
  assert _local_steps(local) == [1]
  flags = [f"--config.{k}={v}" for k, v in overrides.items()]
  logs = two_processes.run(
      lambda i, port: [str(two_processes.REPO / "launch.py"), "--config",
                       str(two_processes.REPO / "experiments/configs/tiny.py:smoke"),
                       "--workdir", str(run), "--config.train.async_checkpoint=False",
                       "--config.train.tensorboard=False", *flags,
                       f"--coordinator_address=localhost:{port}", "--num_processes=2",
                       f"--process_id={i}"], tmp_path, timeout_s=300)
  for log in logs:
    assert "train.local_checkpoint_every=1 is off: 2 processes" in log.read_text()
  assert _local_steps(local) == [1] and checkpoint.recorded_saves(run) == [2, 4]

"""The run records on object storage (moto's S3 server and the local GCS server, fixture
`bucket`) keep the lab-notebook guarantees of a local run directory: the LOCK, the
append-only logs across a kill and a resume, only whole objects, and bounded requests per
step of logging."""

import json
import os
import subprocess
import sys

import pytest

from tests.cli import launch
from train.io import conditional, runlog, storage
from train.lifecycle.lock import LockError, WorkdirLock
from train.metrics import METRICS_FILE, REWOUND_FILE, MetricsWriter, read_metrics


def _line(step, split="train"):
  return {"step": step, "split": split, "loss": 1.0 / step}


def _kill_and_resume(workdir):
  """Attempt 1 logs steps 1-6, checkpoints at 4, its lines to 6 reach storage (a sync
  after the checkpoint), then it is killed (no close). Attempt 2 resumes at 4."""
  first = MetricsWriter(workdir, True, tensorboard=False)
  for step in range(1, 5):
    first.write(_line(step))
  first.write(_line(4, "eval"))
  first.sync()  # The checkpoint at step 4 (train/loop.py syncs before each save).
  for step in (5, 6):
    first.write(_line(step))
  first.sync()  # A later sync (SYNC_S): lines past the last checkpoint are stored.
  del first  # Killed: never closed.
  second = MetricsWriter(workdir, True, tensorboard=False)
  moved = second.truncate_after(4)
  for step in range(5, 9):
    second.write(_line(step))
  second.close()
  return moved


def test_a_killed_attempts_lines_are_rewound_on_a_bucket_as_in_a_local_file(bucket, tmp_path):
  local, bucket = str(tmp_path / "run"), storage.join(bucket, "run")
  os.makedirs(local)
  assert _kill_and_resume(local) == _kill_and_resume(bucket) == 2
  assert read_metrics(bucket) == read_metrics(local)
  assert [(r["step"], r["split"]) for r in read_metrics(bucket)] == [
      (1, "train"), (2, "train"), (3, "train"), (4, "train"), (4, "eval"),
      (5, "train"), (6, "train"), (7, "train"), (8, "train")]  # None lost, none twice.
  assert runlog.read_records(bucket, REWOUND_FILE) == runlog.read_records(local, REWOUND_FILE)
  assert [r["step"] for r in runlog.read_records(bucket, REWOUND_FILE)] == [5, 6]
  # Objects are only ever created: 2 segments, a rewind marker, the resumed segment.
  parts = storage.listdir(runlog.parts_dir(bucket, METRICS_FILE))
  assert parts == [f"{i:08d}.jsonl" for i in range(1, 5)]
  assert json.loads(storage.read_text(storage.join(runlog.parts_dir(bucket, METRICS_FILE),
                                                   parts[2]))) == {runlog.REWIND: 4}


def test_logging_sends_no_request_per_step(bucket):
  """200 logged steps and 2 checkpoints: the requests are per sync, not per line."""
  writer = MetricsWriter(storage.join(bucket, "run"), True, tensorboard=True)
  before = storage.request_count()
  for step in range(1, 201):
    writer.write(_line(step))
    if step % 100 == 0:
      writer.sync()
  writer.close()
  sent = storage.request_count() - before
  # Each sync: one metrics segment, one TensorBoard event file (the first lists once).
  assert sent <= 8, dict(storage.REQUESTS)
  assert len(read_metrics(storage.join(bucket, "run"))) == 200
  events = storage.listdir(storage.join(bucket, "run", "tensorboard"))
  assert len(events) == 2 and all(e.startswith("events.out.tfevents.") for e in events)


def _holder(workdir, record):
  assert conditional.create_exclusive(storage.join(workdir, "LOCK"), json.dumps(record).encode())


def test_the_lock_on_a_bucket_refuses_live_and_foreign_holders_and_takes_over_dead_ones(bucket):
  import socket  # pylint: disable=g-import-not-at-top
  run = storage.join(bucket, "run")
  sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  try:
    _holder(run, {"host": socket.gethostname(), "pid": sleeper.pid, "since": "t", "command": "c"})
    with pytest.raises(LockError, match="in use by another trainer"):
      WorkdirLock(run).acquire()
  finally:
    sleeper.kill()
    sleeper.wait()
  with WorkdirLock(run) as lock:  # Its holder is dead now: taken over.
    assert json.loads(storage.read_text(lock.path))["pid"] == os.getpid()
  assert not storage.exists(storage.join(run, "LOCK"))  # Released.
  _holder(run, {"host": "another-host", "pid": 1, "since": "t", "command": "c"})
  with pytest.raises(LockError, match=r"cannot be checked from host .*delete (s3|gs)://"):
    WorkdirLock(run).acquire()


def test_a_second_trainer_on_a_bucket_run_is_refused_by_the_lock(bucket):
  run = storage.join(bucket, "run")
  sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  try:
    import socket  # pylint: disable=g-import-not-at-top
    _holder(run, {"host": socket.gethostname(), "pid": sleeper.pid, "since": "t",
                  "command": "launch.py"})
    with pytest.raises(LockError, match=f"{run} is in use by another trainer: pid {sleeper.pid}"):
      launch("--workdir", run, "--config.train.steps=2")
  finally:
    sleeper.kill()
    sleeper.wait()
  assert storage.listdir(run) == ["LOCK"]  # Nothing written beside the holder's lock.


def test_a_missing_bucket_is_one_error_naming_the_url(bucket):
  proto = storage.protocol(bucket)
  with pytest.raises(storage.StorageError,
                     match=f"create {proto}://no-such-bucket-38/run/LOCK: no such bucket"):
    launch("--workdir", f"{proto}://no-such-bucket-38/run", "--config.train.steps=2")


def test_train_resume_and_eval_of_a_bucket_run_through_launch(bucket):
  """Train 4 steps into the bucket, an attempt's line past checkpoint 4 left behind (as a
  killed attempt's last sync leaves it), resume to 6, `--mode eval`: every step logged
  once, the stray line rewound (kept), evals.jsonl beside, metrics untouched by eval."""
  from train import load_run  # pylint: disable=g-import-not-at-top
  run = storage.join(bucket, "run")
  flags = ("--workdir", run, "--config.train.log_every=1", "--config.train.eval_every=2",
           "--config.train.checkpoint_every=2", "--config.train.tensorboard=False")
  launch(*flags, "--config.train.steps=4")
  runlog.append(run, METRICS_FILE, [json.dumps({**_line(5), "stray": True}) + "\n"])
  launch(*flags, "--config.train.steps=6")
  records = read_metrics(run)
  assert [(r["step"], r["split"]) for r in records if r["split"] == "train"] == [
      (s, "train") for s in range(1, 7)]
  assert not any(r.get("stray") for r in records)
  assert [r["step"] for r in runlog.read_records(run, REWOUND_FILE)] == [5]
  changes = runlog.read_records(run, "config_changes.jsonl")
  assert [(c["field"], c["old"], c["new"]) for c in changes if c["field"] == "train.steps"] == [
      ("train.steps", 4, 6)]
  out = launch("--mode", "eval", "--workdir", run)
  assert f"recorded in {run}/evals.jsonl" in out
  assert read_metrics(run) == records
  opened = load_run(run)
  assert opened.step == 6 and opened.metrics == records and len(opened.evals) == 1
  assert not storage.exists(storage.join(run, "LOCK"))  # Released at the end.
  assert not os.path.exists(bucket.split("//")[0])  # No local stand-in directory appeared.

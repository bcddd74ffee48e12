"""RUN/LOCK as a lease (train/lifecycle/lock.py) and idempotent conditional writes
(train/io/conditional.py), on a local disk, on moto's S3 server and on the local GCS
server (tests/gcs_server.py: generations, ifGenerationMatch); faults through
tests/fault_proxy.py FaultProxy."""

import datetime
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from train.io import conditional, runlog, storage
from train.lifecycle import lock
from train.lifecycle.lock import LockError, WorkdirLock


@pytest.fixture(params=["local", "s3", "gs"])
def run(request, tmp_path):
  root = str(tmp_path) if request.param == "local" else request.getfixturevalue(
      {"s3": "s3_bucket", "gs": "gcs_bucket"}[request.param])
  return storage.join(root, "run")


def _plant(run, renewed_ago: float, host: str = "gone-host", pid: int = 1, lease_s=60.0):
  """A holder's LOCK as another trainer would have left it."""
  t = time.time() - renewed_ago
  record = {"host": host, "pid": pid, "since": "then", "command": "launch.py", "token": "x",
            "lease_s": lease_s, "renewed": datetime.datetime.fromtimestamp(t).isoformat(),
            "renewed_s": t}
  storage.makedirs(run)
  assert conditional.create_exclusive(storage.join(run, "LOCK"), json.dumps(record).encode())


def _record(run) -> dict:
  return json.loads(storage.read_bytes(storage.join(run, "LOCK")))


def test_a_lock_on_another_host_is_refused_within_its_lease_and_taken_over_after(run):
  _plant(run, renewed_ago=5)
  with pytest.raises(LockError, match=r"in use by another trainer: pid 1 on host gone-host.*"
                     r"last renewed .* \(5 s ago\)\. Its lease is 60 s"):
    WorkdirLock(run).acquire()
  assert lock.live_holder(run)["remote"]
  storage.delete(storage.join(run, "LOCK"))
  _plant(run, renewed_ago=61)  # A preempted pod's old host: not renewed for its lease.
  assert lock.live_holder(run) is None
  with WorkdirLock(run) as held:
    assert _record(run)["token"] == held._record["token"]  # pylint: disable=protected-access
  assert not storage.exists(storage.join(run, "LOCK"))


@pytest.mark.parametrize("holder", ["stale remote", "dead local pid"])
def test_starters_racing_for_a_stale_lock_exactly_one_wins(run, holder):
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True, check=True)
  if holder == "stale remote":
    _plant(run, renewed_ago=600)
  else:
    _plant(run, renewed_ago=0, host=socket.gethostname(), pid=int(dead.stdout))
  n, start, won, refused = 6, threading.Barrier(6), [], []

  def starter():
    mine = WorkdirLock(run)
    start.wait()
    try:
      mine.acquire()
      won.append(mine)
    except LockError as e:
      refused.append(str(e))
  threads = [threading.Thread(target=starter) for _ in range(n)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert len(won) == 1, (len(won), refused)
  assert len(refused) == n - 1 and all("in use by another trainer" in r or "at the same time"
                                       in r for r in refused), refused
  assert _record(run)["pid"] == won[0]._record["pid"]  # pylint: disable=protected-access
  won[0].release()


def test_the_holder_renews_its_lease_and_release_removes_only_its_own_lock(run, request):
  if run.startswith("s3://"):
    # Once in a full `make test` (2 xdist workers) the renewal thread's conditional PUTs
    # to moto failed for the whole second (EndpointConnectionError, NoCredentialsError,
    # then botocore's AttributeError "'NoneType' object has no attribute 'values'"); never
    # alone or beside the other bucket tests. Not understood yet (issue 45): kept running,
    # not counted.
    request.applymarker(pytest.mark.xfail(reason="s3 renewal under the full suite: see "
                                                 "the comment", strict=False))
  held = WorkdirLock(run, lease_s=0.8)
  held.acquire()
  first = _record(run)["renewed_s"]
  deadline = time.time() + 5.0  # A renewal every 0.2 s; a loaded machine may delay a few.
  while _record(run)["renewed_s"] <= first and time.time() < deadline:
    time.sleep(0.2)
  assert _record(run)["renewed_s"] > first
  assert held._renewer.is_alive()  # pylint: disable=protected-access
  held.release()
  assert not storage.exists(storage.join(run, "LOCK"))
  assert held._renewer is None  # pylint: disable=protected-access  (stopped and joined)
  held = WorkdirLock(run, lease_s=60)
  held.acquire()
  held._stop.set()  # pylint: disable=protected-access  (renewals stop: a frozen holder)
  storage.delete(storage.join(run, "LOCK"))
  _plant(run, renewed_ago=0, host="new-host")  # Taken over meanwhile by another trainer.
  held.release()
  assert _record(run)["host"] == "new-host"  # Not its own: left in place.


def test_the_renewal_thread_never_keeps_the_process_alive(tmp_path):
  code = ("from train.lifecycle.lock import WorkdirLock; "
          f"WorkdirLock({str(tmp_path)!r}, lease_s=0.4).acquire(); print('exiting')")
  t = time.time()
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, check=True)
  assert "exiting" in out.stdout and time.time() - t < 30


def test_a_create_whose_answer_is_lost_is_not_written_twice_nor_refused(s3_lossy):
  bucket, proxy = s3_lossy
  run = storage.join(bucket, "run")
  proxy.lose_paths += ["/run/LOCK", "/run/metrics.jsonl.parts/00000001.jsonl"]
  with WorkdirLock(run) as held:  # Its create landed, the answer was lost: still ours.
    assert _record(run)["token"] == held._record["token"]  # pylint: disable=protected-access
    runlog.append(run, "metrics.jsonl", ['{"step": 1}\n'])
  assert len(proxy.lost) == 2, proxy.lost  # Both faults happened.
  assert storage.listdir(runlog.parts_dir(run, "metrics.jsonl")) == ["00000001.jsonl"]
  assert runlog.read_records(run, "metrics.jsonl") == [{"step": 1}]


def test_a_trainer_whose_lock_is_taken_over_stops_without_saving(tmp_path):
  """Through launch.py: the trainer missed its lease and another trainer (on another
  host) took the LOCK over. The holder's next renewal fails; the loop stops at its next
  step with a non-zero exit, saves nothing more and leaves the new holder's LOCK."""
  from tests.cli import launch_cmd  # pylint: disable=g-import-not-at-top
  from tests.train.test_loop import wait_for_step  # pylint: disable=g-import-not-at-top
  run = str(tmp_path / "run")
  proc = subprocess.Popen(launch_cmd("--workdir", run, "--config.train.steps=100000",
                                     "--config.train.log_every=1",
                                     "--config.train.checkpoint_every=100000",
                                     "--config.train.tensorboard=False",
                                     "--config.train.lock_lease_s=1"),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    wait_for_step(run, 2, proc)
    storage.write_bytes(storage.join(run, "LOCK"), json.dumps(
        {"host": "new-host", "pid": 7, "since": "now", "command": "launch.py", "token": "y",
         "lease_s": 60.0, "renewed_s": time.time()}).encode())
    out, _ = proc.communicate(timeout=120)
  finally:
    proc.kill()
  assert proc.returncode == 1, out[-3000:]
  assert "LOCK was taken over by another trainer" in out, out[-3000:]
  assert _record(run)["host"] == "new-host"  # Not its own: left in place.
  assert not os.path.exists(os.path.join(run, "checkpoints", "100000"))

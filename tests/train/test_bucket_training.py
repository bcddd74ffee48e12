"""Training into a bucket through launch.py (moto's S3 server and the local GCS server,
started by the tests; fixture `bucket`): resume is bitwise an uninterrupted run's, a
corrupted checkpoint object is found by its checksum and skipped, and a step without
orbax's commit marker (a save cut by a kill) is never resumed from."""

import signal
import subprocess
import time

import jax
import numpy as np

from tests.cli import launch
from tests.train.test_loop import DETERMINISTIC, launch_cmd, params_of, smoke, train_lines
from train import checkpoint, loop
from train.io import runlog, storage
from train.io.checksums import CHECKSUMS_FILE
from train.metrics import REWOUND_FILE

FLAGS = ("--config.train.async_checkpoint=False", "--config.train.tensorboard=False",
         "--config.train.log_every=1")


def _reference(tmp_path, steps, every):
  """The uninterrupted run, in a local directory."""
  loop.run(smoke(**{"train.steps": steps, "train.log_every": 1,
                    "train.checkpoint_every": every}), str(tmp_path / "reference"))
  return train_lines(str(tmp_path / "reference"))


def _same_losses(got, want):
  assert [r["step"] for r in got] == [r["step"] for r in want]  # None lost, none twice.
  for g, w in zip(got, want):
    assert {k: g[k] for k in DETERMINISTIC} == {k: w[k] for k in DETERMINISTIC}


def _steps(run):
  return sorted(int(s) for s in storage.listdir(checkpoint.checkpoint_dir(run)) if s.isdigit())


def _flip_largest_object(step_dir) -> str:
  found = storage.files(step_dir)
  name = max((k for k in found if "/d/" in k), key=found.get)
  blob = bytearray(storage.read_bytes(f"{step_dir}/{name}"))
  blob[len(blob) // 2] ^= 0xFF
  storage.write_bytes(f"{step_dir}/{name}", bytes(blob))
  return name


def test_a_bucket_run_resumes_bitwise_past_a_corrupted_checkpoint_object(bucket, caplog):
  """The latest checkpoint's largest object is damaged: the resume names it, moves the
  step aside, and trains steps 3-4 again from step 2 to the same bits as the first time
  (the first attempt's lines are the rewound ones)."""
  run = f"{bucket}/run"
  args = ("--workdir", run, *FLAGS, "--config.train.steps=4", "--config.train.checkpoint_every=2")
  launch(*args)
  assert _steps(run) == [2, 4]
  damaged = _flip_largest_object(f"{checkpoint.checkpoint_dir(run)}/4")
  launch(*args)
  assert f"checkpoints/4 is damaged: {damaged} differs from the checksum" in caplog.text
  assert damaged in storage.files(f"{run}/checkpoints_corrupt/4")  # Kept, aside.
  assert _steps(run) == [2, 4]
  first = [r for r in runlog.read_records(run, REWOUND_FILE) if r["split"] == "train"]
  _same_losses(train_lines(run)[2:], first)
  assert [r["step"] for r in train_lines(run)] == [1, 2, 3, 4]


def _wait_for_commit(run, step, proc, timeout=240):
  marker = f"{checkpoint.checkpoint_dir(run)}/{step}/{CHECKSUMS_FILE}"  # Sealed: committed.
  deadline = time.time() + timeout
  while not storage.exists(marker):
    assert proc.poll() is None, f"training exited early with {proc.returncode}"
    assert time.time() < deadline, f"step {step} not checkpointed within {timeout} s"
    time.sleep(0.2)


def _kill_after_commit(run: str, step: int, *flags: str) -> None:
  """Trains `run` in a subprocess and SIGKILLs it once step `step`'s save committed."""
  proc = subprocess.Popen(launch_cmd(run, *flags), stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  try:
    _wait_for_commit(run, step, proc)
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"


def test_sigkill_of_a_bucket_run_then_resume_is_bitwise_and_skips_an_uncommitted_step(
    bucket, tmp_path):
  """Killed after its step-4 checkpoint; the step-4 directory then loses its commit
  marker, as when a host dies before orbax writes it: the resume starts from step 2."""
  run = f"{bucket}/run"
  _kill_after_commit(run, 4, "--config.train.steps=10", "--config.train.log_every=1",
                     "--config.train.checkpoint_every=2", "--config.train.keep_checkpoints=5")
  for step in _steps(run):
    if step >= 4:
      storage.delete(f"{checkpoint.checkpoint_dir(run)}/{step}/{checkpoint.COMMIT_FILE}")
  launch("--workdir", run, *FLAGS, "--config.train.steps=10", "--config.train.checkpoint_every=2",
         "--config.train.keep_checkpoints=5")
  rewound = [r["step"] for r in runlog.read_records(run, REWOUND_FILE)]
  assert rewound and min(rewound) == 3  # Resumed from step 2, not the uncommitted 4.
  _same_losses(train_lines(run), _reference(tmp_path, 10, 2))
  assert _steps(run) == [2, 4, 6, 8, 10]
  for a, b in zip(jax.tree.leaves(params_of(run)), jax.tree.leaves(params_of(tmp_path / "reference"))):
    np.testing.assert_array_equal(a, b)


def test_a_bucket_run_killed_before_its_first_commit_restarts_bitwise(bucket, tmp_path,
                                                                      caplog):
  """Killed while its first save was in flight: the lines up to it were stored (they are
  synced before each save) but the step has no commit marker and checkpoints.jsonl no
  record (written once a save is final). The same command redoes the run from step 0."""
  run = f"{bucket}/run"
  flags = ("--config.train.steps=6", "--config.train.checkpoint_every=4")
  _kill_after_commit(run, 4, "--config.train.log_every=1", *flags)
  storage.delete(f"{checkpoint.checkpoint_dir(run)}/4/{checkpoint.COMMIT_FILE}")
  storage.delete(runlog.parts_dir(run, checkpoint.SAVES_FILE), recursive=True)
  killed = [r["step"] for r in train_lines(run)]
  assert killed[:4] == [1, 2, 3, 4]
  launch("--workdir", run, *FLAGS, *flags)
  assert "killed before its first checkpoint committed; restarting from step 0" in caplog.text
  assert [r["step"] for r in runlog.read_records(run, REWOUND_FILE)
          if r["split"] == "train"] == killed
  _same_losses(train_lines(run), _reference(tmp_path, 6, 4))
  assert checkpoint.recorded_saves(run) == [4, 6]
  for a, b in zip(jax.tree.leaves(params_of(run)), jax.tree.leaves(params_of(tmp_path / "reference"))):
    np.testing.assert_array_equal(a, b)

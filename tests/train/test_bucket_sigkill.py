"""SIGKILL of a trainer writing to s3:// (moto's server) and a resume: the metrics
stream holds every step once, whichever checkpoint the kill left (slow tier)."""

import signal
import subprocess
import time

from tests.cli import launch, launch_cmd
from train import runlog, storage
from train.metrics import REWOUND_FILE, read_metrics

FLAGS = ("--config.train.steps=12", "--config.train.log_every=1",
         "--config.train.checkpoint_every=4", "--config.train.async_checkpoint=False",
         "--config.train.tensorboard=False")


def _train_steps(run):
  return [r["step"] for r in read_metrics(run, warn=False) if r["split"] == "train"]


def test_sigkill_on_a_bucket_then_resume_logs_each_step_once(s3_bucket):
  run = storage.join(s3_bucket, "run")
  # The subprocess inherits the fixture's AWS_ENDPOINT_URL and fake credentials.
  proc = subprocess.Popen(launch_cmd("--workdir", run, *FLAGS), stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  try:
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
      if max(_train_steps(run), default=0) >= 8:  # Step 8's sync: its save under way.
        break
      time.sleep(0.2)
    assert proc.poll() is None, f"training ended early ({proc.returncode})"
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  assert storage.exists(storage.join(run, "LOCK"))  # Killed: never released.
  launch("--workdir", run, *FLAGS)  # A dead local holder's lock is taken over.
  assert _train_steps(run) == list(range(1, 13))  # None lost, none twice.
  rewound = runlog.read_records(run, REWOUND_FILE)
  assert all(r["step"] > r["rewound_to"] for r in rewound)
  evals = [r["step"] for r in read_metrics(run) if r["split"] == "eval"]
  assert len(evals) == len(set(evals)) and evals[-1] == 12

"""A bucket run under an object store's faults and SIGKILLs at random points ends as an
uninterrupted run does (issue 45, item 9): every request of the trainer (s3fs for the
run's records, TensorStore's s3 driver for the arrays) goes through a FaultProxy
(tests/fault_proxy.py) that throttles (503 SlowDown), loses the answers of writes that
landed and resets connections, while the harness SIGKILLs each attempt at a random time
and starts it again with the same command until it finishes. Then: each step's line is
in metrics.jsonl exactly once, bitwise equal to an uninterrupted local run's; every
checkpoint in the bucket verifies against its checksums and the last one restores to the
uninterrupted run's parameters. Slow tier (about a minute or two on 2 cores)."""

import os
import random
import signal
import subprocess
import time

import jax
import numpy as np

from tests.fault_proxy import FaultProxy
from tests.storage_servers import serving
from tests.train.test_loop import DETERMINISTIC, launch_cmd, params_of, smoke, train_lines
from train import checkpoint, loop
from train.io import checksums, storage

STEPS, EVERY = 16, 4
FLAGS = (f"--config.train.steps={STEPS}", f"--config.train.checkpoint_every={EVERY}",
         "--config.train.log_every=1", "--config.train.keep_checkpoints=10",
         "--config.train.async_checkpoint=True")
KILLS = 6  # Attempts SIGKILLed at a random time; the next one is left to finish.


def _attempt(run: str, env: dict, kill_after_s: float | None = None,
             kill_after_step: tuple[int, float] | None = None) -> int:
  """One `launch.py` attempt; its exit status (-9 when the harness killed it).

  Killed `kill_after_s` seconds after its start, or `delay` seconds after step `step`'s
  line reached the bucket (`kill_after_step=(step, delay)`), or left to finish."""
  with open(os.devnull, "w") as quiet:
    proc = subprocess.Popen(launch_cmd(run, *FLAGS), env=env, stdout=quiet, stderr=quiet)
    try:
      if kill_after_step is None:
        proc.wait(timeout=kill_after_s if kill_after_s is not None else 600)
      else:
        step, delay = kill_after_step
        deadline = time.time() + 600
        while proc.poll() is None and _reached(run) < step and time.time() < deadline:
          time.sleep(0.3)
        proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
      proc.send_signal(signal.SIGKILL)
      proc.wait()
  return proc.returncode


def _reached(run: str) -> int:
  return max((r["step"] for r in train_lines(run)), default=0)


def test_random_kills_and_store_faults_leave_the_run_an_uninterrupted_one(
    s3_server, s3_bucket, tmp_path):
  reference = tmp_path / "reference"
  loop.run(smoke(**{"train.steps": STEPS, "train.log_every": 1,
                    "train.checkpoint_every": EVERY}), str(reference))
  run = f"{s3_bucket}/run"
  rng = random.Random(45)
  codes = []
  with serving(FaultProxy(s3_server, seed=45, throttle=0.03, lose=0.03, reset=0.03)) as proxy:
    env = dict(os.environ, AWS_ENDPOINT_URL=proxy.url)
    # Even attempts die at a random time (from start-up on: a preemption before the first
    # checkpoint commits), odd ones within half a second of a random step's line landing in
    # the bucket (lines land as each checkpoint starts: this kills mid-save, mid-run,
    # whatever the machine's load), so both kinds always happen.
    reached = 0
    for attempt in range(KILLS + 3):
      kill_s = kill_step = None
      if attempt < KILLS and attempt % 2 == 0:
        kill_s = rng.uniform(2.0, 14.0)
      elif attempt < KILLS and reached + 1 <= STEPS - EVERY:
        kill_step = (rng.randint(reached + 1, STEPS - EVERY), rng.uniform(0.0, 0.5))
      t = time.time()
      code = _attempt(run, env, kill_s, kill_step)
      reached = _reached(run)
      codes.append((code, round(kill_s or 0, 1), kill_step and kill_step[0],
                    round(time.time() - t, 1), reached))
      if code == 0:
        break
    faults = dict(proxy.faults)
  print("attempts (exit status, kill after s, kill after step, ran s, last step logged):",
        codes, "faults:", faults)
  assert codes[-1][0] == 0, f"(exit status, kill s, kill step, ran s, step) per attempt: {codes}"
  assert any(c[0] == -9 and 0 < c[4] < STEPS for c in codes[:-1]), codes  # Kills mid-run.
  assert all(f > 0 for f in (faults.get("throttle"), faults.get("lose"), faults.get("reset"))), faults

  got, want = train_lines(run), train_lines(str(reference))
  assert [r["step"] for r in got] == list(range(1, STEPS + 1)), codes  # None lost, none twice.
  for g, w in zip(got, want):
    assert {k: g[k] for k in DETERMINISTIC} == {k: w[k] for k in DETERMINISTIC}, (g["step"], codes)
  steps = sorted(int(s) for s in storage.listdir(checkpoint.checkpoint_dir(run)) if s.isdigit())
  assert steps and steps[-1] == STEPS, steps
  for step in steps:
    checksums.verify(checkpoint.checkpoint_dir(run), step)  # Raises CheckpointDamaged.
  for a, b in zip(jax.tree.leaves(params_of(run)), jax.tree.leaves(params_of(reference))):
    np.testing.assert_array_equal(a, b)

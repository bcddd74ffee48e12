"""The goodput ledger (train/lifecycle/goodput.py) through launch.py: each attempt's categories in
RUN/goodput.jsonl, summing to the wall time; a run killed once and resumed counts the
steps it trained again; load_run(...).goodput and the report's goodput.md / goodput.csv."""

import csv
import math
import os
import signal
import subprocess
import time

import pytest

from experiments import report
from tests.cli import fail_if_crashed, launch
from tests.train.test_loop import launch_cmd, train_lines, wait_for_step
from train import load_run
from train.io import runlog
from train.lifecycle import goodput

SUMMED = 1e-6  # The categories sum to the wall time exactly, up to float rounding.


def _sums_to_wall(g: goodput.Goodput) -> None:
  assert math.isclose(sum(g.seconds.values()), g.wall_s, rel_tol=SUMMED), g.seconds
  assert all(v >= 0 for k, v in g.seconds.items() if k != "between"), g.seconds
  assert g.goodput == pytest.approx(g.seconds["productive"] / g.wall_s)


def test_two_attempts_are_recorded_and_reported(tmp_path):
  """Two launches (the second continues to more steps): one ledger record set each, the
  second restoring; nothing written by a launch with nothing to train."""
  run = tmp_path / "run"
  flags = ("--workdir", str(run), "--config.train.log_every=1",
           "--config.train.checkpoint_every=2", "--config.train.tensorboard=False")
  launch(*flags, "--config.train.steps=3")
  launch(*flags, "--config.train.steps=5")
  lines = runlog.read_records(str(run), goodput.GOODPUT_FILE)
  launch(*flags, "--config.train.steps=5")  # Already finished: the run is unchanged.
  assert runlog.read_records(str(run), goodput.GOODPUT_FILE) == lines
  g = load_run(str(run)).goodput
  assert g == goodput.summary(str(run))
  assert len(g.attempts) == 2 and g.steps == {"productive": 5, "redone": 0}
  first, second = g.attempts
  assert first["seconds"]["restore"] == 0 < second["seconds"]["restore"]
  for a in g.attempts:
    for category in ("startup", "compile", "data", "productive", "checkpoint", "eval"):
      assert a["seconds"][category] > 0, (category, a)
  assert g.seconds["between"] == pytest.approx(second["start"] - first["time"])
  _sums_to_wall(g)

  paths = report.write_report(str(tmp_path))
  with open(paths["goodput_csv"]) as f:
    (row,) = list(csv.DictReader(f))
  assert row["run"] == "run" and float(row["goodput"]) == pytest.approx(g.goodput)
  assert sum(float(row[f"{k}_s"]) for k in goodput.CATEGORIES) == pytest.approx(g.wall_s)
  with open(paths["goodput_md"]) as f:
    text = f.read()
  assert f"| run | {100 * g.goodput:.1f}% | {g.wall_s:.1f} s | 2 | 5 (0) |" in text


def test_a_run_killed_once_counts_the_steps_it_trained_again(tmp_path):
  """SIGKILL after the step-4 checkpoint, then the same command: the second attempt's
  steps from its checkpoint to the killed one's last are redone, the rest productive; the
  ledger's wall time is the harness's, less the last process's exit."""
  cmd = launch_cmd(tmp_path, "--config.train.steps=12", "--config.train.log_every=1",
                   "--config.train.checkpoint_every=4")
  t0 = time.time()
  proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    wait_for_step(tmp_path, 6, proc)
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  killed = goodput.trained_steps(str(tmp_path))  # The ledger may know a step past the lines.
  assert killed >= max(r["step"] for r in train_lines(tmp_path)) >= 6
  saved = max(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit())
  done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
  wall = time.time() - t0
  fail_if_crashed(cmd, done.returncode, done.stdout + done.stderr)
  assert done.returncode == 0, done.stderr[-2000:]
  g = goodput.summary(str(tmp_path))
  assert len(g.attempts) == 2
  assert g.attempts[1]["steps"] == {"productive": 12 - killed, "redone": killed - saved}
  assert (g.attempts[1]["seconds"]["redone"] > 0) == (killed > saved)
  assert g.seconds["between"] > 0
  _sums_to_wall(g)
  assert wall - 5 < g.wall_s <= wall, (g.wall_s, wall)


def test_laps_sum_to_the_wall_and_a_lost_or_repeated_record_changes_nothing(
    tmp_path, monkeypatch):
  """The ledger's arithmetic on a fake clock: an attempt is its last record (cumulative;
  duplicates and earlier ones ignored), between is the next start less the last record,
  and steps up to the highest trained before are redone."""
  now = [100.0]
  monkeypatch.setattr(goodput.time, "time", lambda: now[0])
  runlog.append(str(tmp_path), "metrics.jsonl", ['{"step": 3, "split": "train"}\n'])
  first = goodput.Ledger(str(tmp_path), True, start=90.0)
  first.lap("startup")  # 10 s
  first.begin(0)  # Step 3 was logged by an attempt before: steps 1-3 are redone.
  for step in range(1, 6):
    now[0] += 2.0
    first.lap("data")
    now[0] += 1.0
    first.step(step)
  first.step(5)  # Charged to step 5 again (a save's wait): counted once.
  first.flush()
  first.flush()  # A repeated record (a retried append) is the same attempt.
  now[0] += 7.0  # The kill, and the wait before the next start.
  second = goodput.Ledger(str(tmp_path), True, start=now[0])
  now[0] += 4.0
  second.lap("restore")
  second.begin(4)  # Step 5 is redone: the first attempt's record reached it.
  now[0] += 3.0
  second.step(5)
  now[0] += 1.0
  second.close()
  g = goodput.summary(str(tmp_path))
  assert [a["attempt"] for a in g.attempts] == [first.attempt, second.attempt]
  assert g.wall_s == now[0] - 90.0 == 40.0
  assert g.seconds == {"productive": 2.0, "redone": 3.0 + 3.0, "compile": 0.0, "data": 10.0,
                       "checkpoint": 1.0, "restore": 4.0, "eval": 0.0, "startup": 10.0,
                       "between": 7.0}
  assert g.steps == {"productive": 2, "redone": 4}
  _sums_to_wall(g)
  assert g.goodput == 2.0 / 40.0

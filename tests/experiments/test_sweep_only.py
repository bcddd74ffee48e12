"""A subset of a sweep's points (--sweep_only) and a sweep stopped with SIGTERM (issue 28,
items 10 and 14), through launch.py."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from tests.cli import fail_if_crashed, launch, launch_cmd
from tests.experiments.test_sweep import CONFIG


@pytest.fixture
def config(tmp_path):
  path = tmp_path / "two_points.py"
  path.write_text(CONFIG)
  return str(path)


def test_sweep_only_emits_the_matching_points_in_order_run_by_this_interpreter(config,
                                                                               tmp_path):
  out = launch("--config", f"{config}:bad", "--workdir", str(tmp_path / "runs"),
               "--sweep_emit=commands", "--sweep_only=pairs*")
  argvs = [shlex.split(line) for line in out.splitlines()]
  assert [a[a.index("--workdir") + 1] for a in argvs] == [
      str(tmp_path / "runs" / "pairs2"), str(tmp_path / "runs" / "pairs4")]  # Sweep order.
  assert all(a[0] == sys.executable for a in argvs)


def test_sweep_only_refuses_a_pattern_that_matches_no_point(config, tmp_path):
  with pytest.raises(ValueError, match=r"--sweep_only=rope,pairs2: 'rope' pattern matches no "
                                       "point; the points are pairs2, bad, pairs4"):
    launch("--config", f"{config}:bad", "--workdir", str(tmp_path / "runs"), "--sweep",
           "--sweep_only=rope,pairs2")
  assert not (tmp_path / "runs").exists()


def _train_lines(run_dir):
  try:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
      return [json.loads(l) for l in f if '"train"' in l]
  except (OSError, ValueError):
    return []


def test_sigterm_to_a_parallel_sweep_reaches_its_points_which_save_and_are_waited_for(
    config, tmp_path):
  runs = tmp_path / "runs"
  parent = subprocess.Popen(
      launch_cmd("--config", f"{config}:bad", "--workdir", str(runs), "--sweep",
                 "--sweep_parallel=2", "--sweep_only=pairs2,pairs4",
                 "--config.train.steps=100000", "--config.train.eval_every=100000",
                 "--config.train.checkpoint_every=100000"),
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      env={**os.environ, "XLA_FLAGS": ""})  # One CPU device per point: quicker to compile.
  try:
    deadline = time.time() + 240
    while not all(_train_lines(runs / p) for p in ("pairs2", "pairs4")):
      assert parent.poll() is None and time.time() < deadline, parent.stdout.read()[-3000:]
      time.sleep(0.5)
    parent.send_signal(signal.SIGTERM)
    out, _ = parent.communicate(timeout=180)
  finally:
    if parent.poll() is None:
      parent.kill()
  fail_if_crashed(parent.args, parent.returncode, out)
  assert parent.returncode == 0, out[-3000:]
  for name in ("pairs2", "pairs4"):
    assert re.search(rf"^{name}\s+preempted$", out, re.M), out[-3000:]
    steps = [int(s) for s in os.listdir(runs / name / "checkpoints") if s.isdigit()]
    assert steps and max(steps) >= _train_lines(runs / name)[-1]["step"]  # Saved on SIGTERM.
    assert not (runs / name / "LOCK").exists()  # The point's trainer has exited.
  assert not (runs / "bad").exists()  # Not selected.
  with open(runs / "sweep.json") as f:  # Every point, in order: the report's row order.
    assert [p["name"] for p in json.load(f)["points"]] == ["pairs2", "bad", "pairs4"]

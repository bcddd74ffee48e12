"""What the fault probes found (issue 37, item 8): a SIGKILLed --sweep_parallel parent's
points, a run whose trainer still holds its LOCK or that failed after its final eval, a
sweep at one token budget given a compute law."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from experiments import report, sweep
from tests.cli import launch_cmd
from tests.experiments.test_report import _write_run

# Two points that would train for many minutes: only a dead parent can end them early.
LONG = textwrap.dedent('''
    from experiments.configs import base

    def get_config(arg=None):
      c = base.get_config("smoke")
      c.data.update(corpus="mqar", mqar_num_kv_pairs=2, seq_len=16, batch_size=8)
      c.model.update(d_model=16, num_layers=1, num_heads=2, num_kv_heads=2, mlp_dim=32)
      c.train.update(steps=1_000_000, log_every=1000, eval_every=100_000,
                     checkpoint_every=100_000, tensorboard=False)
      c.hardware.peak_flops = 1e12
      return c

    def sweep(arg=None):
      return [{"name": f"p{i}", "train.seed": i} for i in (0, 1)]
''')


def _points_of(workdir: str) -> set[int]:
  """Pids of the launch.py processes training into `workdir`'s points."""
  out = set()
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    except OSError:
      continue
    if b"--sweep" not in argv and any(a.startswith(workdir.encode() + b"/p") for a in argv):
      out.add(int(pid))
  return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG: Linux")
def test_a_killed_parallel_sweep_takes_its_points_with_it(tmp_path):
  config = tmp_path / "long.py"
  config.write_text(LONG)
  workdir = str(tmp_path / "runs")
  parent = subprocess.Popen(launch_cmd("--config", str(config), "--workdir", workdir,
                                       "--sweep", "--sweep_parallel=2"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    deadline = time.time() + 120
    while len(_points_of(workdir)) < 2 and time.time() < deadline:
      time.sleep(0.2)
    points = _points_of(workdir)
    assert len(points) == 2, "the sweep did not start its two points"
    parent.send_signal(signal.SIGKILL)  # No handler runs: the kernel must end the points.
    parent.wait()
    deadline = time.time() + 90
    while _points_of(workdir) and time.time() < deadline:
      time.sleep(0.2)
    assert not _points_of(workdir), "orphaned sweep points still train"
  finally:
    for pid in _points_of(workdir) | {parent.pid}:
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass


@pytest.fixture
def no_plots(monkeypatch):
  """The tables and notes only: drawing the figures costs seconds and is tested apart."""
  from experiments.report import style as report_style  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(report_style, "pyplot", lambda: None)


def test_a_run_still_training_or_failed_after_its_final_eval_is_not_finished(tmp_path,
                                                                              no_plots):
  for name in ("done", "orphan", "late"):
    _write_run(tmp_path / name, 4, 0, 2.0)  # Every one's metrics reach the final step.
  sleeper = subprocess.Popen(["sleep", "60"])  # A live trainer on this host.
  try:
    import socket  # pylint: disable=g-import-not-at-top
    (tmp_path / "orphan" / "LOCK").write_text(json.dumps({
        "host": socket.gethostname(), "pid": sleeper.pid, "since": "2026-12-02T20:00:00",
        "command": "launch.py"}))
    (tmp_path / "late" / "FAILED").write_text(
        "Traceback (most recent call last):\nOSError: checkpoint flush failed\n")
    paths = report.write_report(str(tmp_path))
    assert set(paths.excluded) == {"orphan", "late"}
    assert paths.excluded["orphan"].startswith(f"still training: LOCK held by pid {sleeper.pid}")
    assert paths.excluded["late"] == (
        "failed: OSError: checkpoint flush failed (after its final eval at step 10: its "
        "metrics are complete, its run is not; re-run the point to settle it)")
    # A re-run sweep leaves the orphan alone and retries the late failure.
    status = {}
    pts = [sweep.Point(n, {}) for n in ("done", "orphan", "late")]
    with pytest.MonkeyPatch.context() as m:
      m.setattr(sweep, "point_config", lambda *a: type("C", (), {"train": type(
          "T", (), {"steps": 10})})())
      pending = sweep._pending  # pylint: disable=protected-access
      todo = pending("x.py", None, str(tmp_path), (), pts, status)
    assert [p.name for p in todo] == ["late"]
    assert status == {"done": "skipped", "orphan": "running"}
  finally:
    sleeper.kill()
    sleeper.wait()  # Reaped, as init reaps an orphan's exit.
  assert report.write_report(str(tmp_path)).excluded.keys() == {"late"}  # Its holder died.


def _width_run(root, param, width, lr, loss):
  name = f"{param}-w{width}-lr{lr:g}-s0"
  _write_run(root / name, 4, 0, loss)
  record = json.loads((root / name / "config.json").read_text())
  record["model"].update(d_model=width, mlp_dim=4 * width,
                         mup_base_width=32 if param == "mup" else 0)
  record["train"]["lr"] = lr
  (root / name / "config.json").write_text(json.dumps(record))
  lines = [json.loads(l) for l in (root / name / "metrics.jsonl").read_text().splitlines()]
  for l in lines:
    if l["split"] == "train":
      l["tokens_seen"] = l["step"] * 256
  (root / name / "metrics.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))


def test_a_sweep_at_one_token_budget_gets_no_compute_law(tmp_path, no_plots):
  """The µP transfer sweep (widths x lrs at one budget) has no frontier to fit."""
  pytest.importorskip("scipy")
  for param in ("sp", "mup"):
    for width, base in ((32, 3.0), (64, 2.6), (128, 2.4)):
      for lr, extra in ((1e-3, 0.1), (3e-3, 0.0)):
        _width_run(tmp_path, param, width, lr, base + extra + (0.3 if param == "mup" else 0))
  paths = report.write_report(str(tmp_path))
  assert "lr_markdown" in paths  # The lr grid's table is there.
  assert not {"fits", "fits_markdown"} & set(paths)
  assert "reaches" not in paths.notes and "L(C)" not in paths.notes

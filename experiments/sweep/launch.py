"""Sweep points as processes: launch.py command lines, a SLURM job-array
script, and the local pool behind `--sweep_parallel=N`.

Each point's command is `python launch.py --config <file>:<arg> --workdir
<workdir>/<name>` plus the point's overrides as `--config.<path>=<value>` flags
and then the sweep's own command-line flags, so the process computes the same
config as experiments.sweep.point_config, and re-running it resumes the point.
A local pool's points die with the sweep (SIGTERM, saving a checkpoint, when the
sweep process dies, even by SIGKILL: train/lifecycle/signals.py die_with_parent).
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

# Names, not the module: the package binds `points` to points.py's function of that name.
from experiments.sweep.points import (Point, clear_failure, final_figures, is_finished,
                                      point_config, points, record_failure, select)
from train.io import storage
from train.lifecycle.signals import PARENT_ENV, StopSignals
from train.metrics import Countdown

log = logging.getLogger(__name__)

# The repository root's launch.py: experiments/sweep/launch.py -> ../../launch.py.
LAUNCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "launch.py")
LOG = "sweep.log"  # A subprocess point's stdout and stderr.


# Commands --------------------------------------------------------------------


def _flag_value(value: Any) -> str:
  if isinstance(value, (list, tuple)):
    return "(" + ",".join(repr(v) for v in value) + ("," if len(value) == 1 else "") + ")"
  return str(value)


def point_flags(point: Point) -> list[str]:
  return [f"--config.{path}={_flag_value(v)}" for path, v in point.overrides.items()]


def _launch_path() -> str:
  rel = os.path.relpath(LAUNCH)
  return LAUNCH if rel.startswith("..") else rel


def point_command(config_path: str, arg: str | None, point: Point, workdir: str,
                  flags: Sequence[str] = (), python: str = "python") -> list[str]:
  """The launch.py command line that trains (or resumes) this one point; for an
  evaluation point, the `--mode eval` of its trained point into its directory."""
  spec = f"{config_path}:{arg}" if arg else config_path
  if point.convert_from is not None:
    raise ValueError(f"point {point.name!r} is converted from {point.convert_from!r} (uptraining):"
                     " --sweep_emit cannot express the conversion step yet; run the sweep with "
                     "--sweep (or --sweep_parallel), which converts and then trains it")
  if point.eval_of is not None:
    evals = [f for f in point_flags(point) + list(flags) if f.startswith("--config.eval.")]
    step = [] if point.eval_step is None else ["--step", str(point.eval_step)]
    return [python, _launch_path(), "--mode", "eval", "--config", spec, "--workdir",
            os.path.join(workdir, point.eval_of), "--eval_into",
            os.path.join(workdir, point.name), *step, *evals]
  return [python, _launch_path(), "--config", spec, "--workdir",
          os.path.join(workdir, point.name), *point_flags(point), *flags]


def _emittable(config_path: str, arg: str | None) -> list[Point]:
  pts = points(config_path, arg)
  for p in pts:
    if p.branch_of is not None:
      raise ValueError(f"point {p.name!r} is a decay branch of {p.branch_of!r}: --sweep_emit "
                       "cannot express the branch step (copying the source's checkpoint) yet; "
                       "run the sweep with --sweep, which branches and then trains it")
  return pts


def emit_commands(config_path: str, arg: str | None, workdir: str,
                  flags: Sequence[str] = (), only: Sequence[str] | None = None) -> str:
  """One shell command per point, one per line (for xargs, GNU parallel, a scheduler),
  run by the interpreter that emitted them; `only`: points.py's select patterns."""
  pts = select(_emittable(config_path, arg), only)
  return "".join(shlex.join(point_command(config_path, arg, p, workdir, flags,
                                          python=sys.executable)) + "\n" for p in pts)


def slurm_script(config_path: str, arg: str | None, workdir: str,
                 flags: Sequence[str] = (), only: Sequence[str] | None = None) -> str:
  """A SLURM job-array script: task i trains point i (re-submitting resumes)."""
  pts = select(_emittable(config_path, arg), only)
  spec = f"{config_path}:{arg}" if arg else config_path
  lines = [
      "#!/bin/bash",
      f"# Sweep {spec} -> {workdir}: {len(pts)} points. Submit with: sbatch <this file>",
      f"#SBATCH --job-name={os.path.basename(os.path.normpath(workdir)) or 'sweep'}",
      f"#SBATCH --array=0-{len(pts) - 1}",
      "#SBATCH --output=%x-%A_%a.out",
      "# Add your cluster's resources, e.g. #SBATCH --gres=gpu:1 --cpus-per-task=8 --time=4:00:00",
      "set -euo pipefail",
      f"cd {shlex.quote(os.getcwd())}",
      'case "${SLURM_ARRAY_TASK_ID}" in',
  ]
  evals = [i for i, p in enumerate(pts) if p.eval_of is not None]
  if evals:  # Sweeps list evaluation points after the trained ones (points.py's resolve).
    lines[3] = f"#SBATCH --array=0-{evals[0] - 1}"
    lines.insert(2, f"# Tasks {evals[0]}-{evals[-1]} evaluate trained points: submit them after "
                    f"the others finish: sbatch --array={evals[0]}-{evals[-1]} <this file>")
  for i, p in enumerate(pts):
    cmd = point_command(config_path, arg, p, workdir, flags, python=sys.executable)
    lines.append(f"  {i}) {shlex.join(cmd)} ;;")
  lines += ['  *) echo "no sweep point ${SLURM_ARRAY_TASK_ID}" >&2; exit 1 ;;', "esac", ""]
  return "\n".join(lines)


# The local pool -----------------------------------------------------------------


def _tail(path: str, lines: int = 60) -> str:
  try:
    with open(path, errors="replace") as f:
      return "".join(f.readlines()[-lines:])
  except OSError:
    return ""


class _Logs:
  """Where the pool's points write their sweep.log: into the run directory, or, under a
  bucket root, a local file uploaded into it (once, whole) when the point ends."""

  def __init__(self, workdir: str):
    self.workdir = workdir
    self.local = tempfile.mkdtemp(prefix="sweep-logs-") if storage.is_url(workdir) else None

  def path(self, name: str) -> str:
    here = os.path.join(self.local or self.workdir, name)
    os.makedirs(here, exist_ok=True)
    return os.path.join(here, LOG)

  def settle(self, name: str, out) -> None:
    out.close()
    if self.local:
      with open(self.path(name), "rb") as f:
        storage.write_bytes(storage.join(self.workdir, name, LOG), f.read())

  def close(self) -> None:
    if self.local:
      shutil.rmtree(self.local, ignore_errors=True)


def run_subprocesses(config_path, arg, workdir, flags, todo, status, parallel) -> None:
  """Runs `todo` as launch.py processes, `parallel` at a time. A SIGTERM / SIGINT to the
  sweep is passed on to the running points, which save a checkpoint, and waited for;
  they (and the points not started) are "preempted"."""
  queue, running, countdown = list(todo), {}, Countdown(len(todo))
  logs = _Logs(workdir)
  # Python's default SIGTERM would end the sweep at once, its points training on as orphans.
  with StopSignals() as stop:
    try:
      _pool(config_path, arg, workdir, flags, queue, running, status, parallel, countdown,
            stop.flag, logs)
    finally:  # Stopped or interrupted: the points get SIGTERM, save and exit.
      for p, _, out, proc in running.values():
        proc.terminate()
      for p, _, out, proc in running.values():
        proc.wait()
        logs.settle(p.name, out)
        status.setdefault(p.name, "preempted")
      logs.close()
      if running:
        log.warning("sweep stopped: %d running points saved their checkpoints (%s); re-run "
                    "the same command to continue", len(running), ", ".join(running))
      for p in queue:  # Not started; stopped with the sweep when it was signalled.
        status.setdefault(p.name, "preempted" if stop.flag.is_set() else "pending")


def _pool(config_path, arg, workdir, flags, queue, running, status, parallel, countdown,
          stop, logs) -> None:
  """Starts points from `queue` into `running` and settles those that end, until both
  are empty or `stop` is set."""
  while (queue or running) and not stop.is_set():
    while queue and len(running) < parallel:
      p = queue.pop(0)
      clear_failure(storage.join(workdir, p.name))
      cmd = point_command(config_path, arg, p, workdir, flags, python=sys.executable)
      out = open(logs.path(p.name), "w")
      env = {**os.environ, PARENT_ENV: str(os.getpid())}  # Dies (saving) if the sweep does.
      running[p.name] = (p, cmd, out, subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                                       env=env))
      log.info("sweep point %s started: %s", p.name, shlex.join(cmd))
    time.sleep(0.2)
    for name, (p, cmd, out, proc) in list(running.items()):
      if proc.poll() is None:
        continue
      logs.settle(name, out)
      del running[name]
      run_dir = storage.join(workdir, name)
      if proc.returncode:
        record_failure(
            run_dir, f"command: {shlex.join(cmd)}\nexit code: {proc.returncode}"
                     f"\n\nlast lines of {LOG}:\n{_tail(logs.path(name))}")
        status[name] = "failed"
      else:
        steps = int(point_config(config_path, arg, p, flags).train.steps)
        status[name] = "done" if is_finished(run_dir, steps) else "unfinished"
      figures = final_figures(run_dir) if status[name] == "done" else ""
      log.info("sweep point %s %s%s; sweep: %s", name, status[name], figures, countdown.tick())


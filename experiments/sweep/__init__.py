"""Sweeps: a config's `sweep(arg)` -> one run directory per point -> run or emitted.

A config module that defines `sweep(arg)` returns its points as override dicts,
{config path: value}, each with a readable run name under the key "name"
(`{"name": "kv2-s1", "model.num_kv_heads": 2, "train.seed": 1}`). Point p's
config is `get_config(arg)`, then p's overrides, then the command line's
`--config.x=y` flags (so `--config.train.steps=2` shortens every point).

    python launch.py --config experiments/configs/gqa_ablation.py:smoke --workdir runs/gqa --sweep
    ... --sweep_parallel=4          # 4 points at a time, each in its own launch.py process
    ... --sweep_emit=commands       # print one launch command per point
    ... --sweep_emit=slurm          # print a SLURM array script (one task per point)

Point p runs into `<workdir>/<p.name>/`. A point with `"eval_of": "<trained point>"`
and `eval.*` overrides only is an evaluation: after the trained points, the
trained point's final checkpoint is evaluated with those overrides into the
evaluation point's own directory (config.json + one eval line, no checkpoints;
experiments/sweep/eval.py), so one training serves many evaluations. A point is finished when its
metrics.jsonl has an eval line at its config's train.steps; finished points are
skipped and unfinished ones resume from their checkpoints, so re-running the
same command continues a sweep. Every selected point's config is built
and validated (train/spec) before any trains: invalid ones (a misspelt
field, a mixture naming no dataset) refuse the whole sweep in one error naming
each, and nothing is written. A point that raises while it runs (or whose process
exits non-zero) gets `<workdir>/<name>/FAILED` with the traceback and the sweep
goes on; the next run retries it. When any point failed, `main` prints each one's
name, FAILED path and error after the status table and exits 1 (a preempted
point is no failure: exit 0). `<workdir>/sweep.json` records the points.
One process trains the points in turn (multi-host safe); experiments/sweep/launch.py
builds the per-point commands and runs the local pool of `--sweep_parallel`. Each
point's outcome is logged with its final eval figures (loss, bits per byte, each
domain's), the points done / total, elapsed time and an ETA.
Points and their configs are experiments/sweep/points.py's (the modules' shared base).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import traceback
from typing import Sequence

from experiments.sweep import branch as sweep_branch, eval as sweep_eval, launch as sweep_launch
# The points and their configs live in points.py (the base module); config files
# and callers reach them here too (`sweep.seeds`, `sweep.point_config`, ...).
from experiments.sweep.points import (  # pylint: disable=unused-import
    FAILED, Point, check_points, clear_failure, final_figures, is_finished, load_module,
    parse_flags, point_config, points, primary, record_failure, seeds, select, set_task,
    set_value)
from train.io import storage
from train.lifecycle.lock import describe_holder, live_holder
from train.loop import run
from train.metrics import Countdown

log = logging.getLogger(__name__)

SWEEP_FILE = "sweep.json"
# A traceback's last line, "ValueError: ..." or "jax.errors.SomeError: ...".
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b(:.*)?$")


# Running ---------------------------------------------------------------------


def _write_sweep_file(config_path, arg, workdir, flags, pts) -> None:
  if not primary():
    return
  storage.makedirs(workdir)
  record = {"config": config_path, "arg": arg, "flags": list(flags),
            "points": [{"name": p.name, "overrides": p.overrides} for p in pts]}
  storage.write_text(storage.join(workdir, SWEEP_FILE), json.dumps(record, indent=2, default=list))


def _pending(config_path, arg, workdir, flags, pts, status) -> list[Point]:
  """Points still to run (every config was checked first). Finished ones are settled, but
  not one with a FAILED file (it failed after its final eval: retried) nor one whose LOCK
  a live trainer holds (an earlier sweep's orphan, another job): "running", left alone."""
  todo = []
  for p in pts:
    run_dir = storage.join(workdir, p.name)
    steps = int(point_config(config_path, arg, p, flags).train.steps)
    holder = live_holder(run_dir)
    if holder:
      status[p.name] = "running"
      log.warning("sweep point %s: %s; not started again", p.name, describe_holder(holder))
    elif is_finished(run_dir, steps) and not storage.exists(storage.join(run_dir, FAILED)):
      status[p.name] = "skipped"
    else:
      todo.append(p)
  return todo


def _announce_finished(config_path, arg, workdir, flags, pts) -> None:
  """Says up front which points a re-run skips: those finished before it started (their
  final eval logged, no FAILED file); the end's table says it again."""
  done = []
  for p in pts:
    run_dir = storage.join(workdir, p.name)
    steps = int(point_config(config_path, arg, p, flags).train.steps)
    step = steps if p.eval_of is None or p.eval_step is None else int(p.eval_step)
    if is_finished(run_dir, step) and not storage.exists(storage.join(run_dir, FAILED)):
      done.append(p.name)
  if done:
    log.info("sweep: %d of %d points already finished, skipped: %s", len(done), len(pts),
             ", ".join(done))


def _run_in_process(config_path, arg, workdir, flags, todo, status) -> None:
  countdown = Countdown(len(todo))
  for i, p in enumerate(todo):
    run_dir = storage.join(workdir, p.name)
    clear_failure(run_dir)
    log.info("sweep point %s (%d/%d)", p.name, i + 1, len(todo))
    try:
      config = point_config(config_path, arg, p, flags)
      result = run(config, run_dir)
    except Exception:  # pylint: disable=broad-except
      record_failure(run_dir, traceback.format_exc())
      log.error("sweep point %s failed; traceback in %s", p.name, storage.join(run_dir, FAILED))
      status[p.name] = "failed"
      log.info("sweep point %s failed; sweep: %s", p.name, countdown.tick())
      continue
    if result.preempted:  # The job is being stopped: leave the rest for the rerun.
      status[p.name] = "preempted"
      for q in todo[i + 1:]:
        status[q.name] = "pending"
      return
    status[p.name] = "done" if is_finished(run_dir, int(config.train.steps)) else "unfinished"
    figures = final_figures(run_dir) if status[p.name] == "done" else ""
    log.info("sweep point %s %s%s; sweep: %s", p.name, status[p.name], figures,
             countdown.tick())


def run_sweep(config_path: str, arg: str | None, workdir: str, parallel: int = 1,
              flags: Sequence[str] = (), only: Sequence[str] | None = None) -> dict[str, str]:
  """Runs every unfinished point (of those `only` selects: names or globs); returns
  {name: "done" | "skipped" | "failed" | "preempted" | "unfinished" | "pending" | "running"}
  in sweep
  order. parallel=1 trains in this process (multi-host safe); parallel>1 runs that many
  launch.py processes at a time. sweep.json always records every point, so a report
  over runs made by subsets keeps the sweep's order."""
  if parallel < 1:
    raise ValueError(f"--sweep_parallel={parallel}: must be >= 1")
  every = sweep_branch.with_keep_steps(config_path, arg, flags, points(config_path, arg))
  pts = select(every, only)
  check_points(config_path, arg, pts, flags)  # All refused at once, before anything runs.
  _write_sweep_file(config_path, arg, workdir, flags, every)
  _announce_finished(config_path, arg, workdir, flags, pts)
  status: dict[str, str] = {}
  evals = [p for p in pts if p.eval_of is not None]
  later = lambda p: p.convert_from is not None or p.branch_of is not None
  stages = [[p for p in pts if p.eval_of is None and not later(p)],
            [p for p in pts if later(p)]]
  for i, stage in enumerate(stages):
    if i == 1:  # Conversions and branches need their trained sources; step-0 evaluations.
      sources = {p.name: p for p in every if p.eval_of is None and not later(p)}
      sweep_eval.run_conversions(config_path, arg, workdir, flags,
                                 [p for p in stage if p.convert_from], status, sources)
      sweep_branch.run_branches(config_path, arg, workdir, flags,
                                [p for p in stage if p.branch_of], status, sources)
      sweep_eval.run_evals(config_path, arg, workdir, flags, evals, status)
    todo = _pending(config_path, arg, workdir, flags, [p for p in stage if p.name not in status],
                    status)
    if parallel == 1:
      _run_in_process(config_path, arg, workdir, flags, todo, status)
    else:
      sweep_launch.run_subprocesses(config_path, arg, workdir, flags, todo, status, parallel)
    if "preempted" in status.values():
      return {p.name: status.get(p.name, "pending") for p in pts}
  sweep_eval.run_evals(config_path, arg, workdir, flags, evals, status)
  return {p.name: status.get(p.name, "pending") for p in pts}


def last_error(text: str) -> str:
  """The error a FAILED file reports: its traceback's final exception line (the
  exception's type and message), else its last non-empty line."""
  lines = [l.rstrip() for l in text.splitlines() if l.strip()]
  for line in reversed(lines):
    if _EXCEPTION_LINE.match(line):
      return line
  return lines[-1] if lines else "(empty)"


def failure_summary(workdir: str, names: Sequence[str]) -> str:
  """One line per failed point: its name, FAILED file and error."""
  out = [f"{len(names)} failed (re-run the same command to retry them):"]
  for name in names:
    path = storage.join(workdir, name, FAILED)
    try:
      error = last_error(storage.read_bytes(path).decode(errors="replace"))
    except OSError:  # Another host's process wrote it, or it could not be written.
      error = "(no FAILED file)"
    out.append(f"  {name}: {error}\n    {path}")
  return "\n".join(out)


def main(config_path: str, config_arg: str | None, workdir: str, parallel: int = 1,
         emit: str | None = None, overrides: Sequence[str] = (),
         only: Sequence[str] | None = None) -> dict[str, str] | None:
  """launch.py's --sweep / --sweep_emit entry point. Raises SystemExit(1) after
  printing the status when any point failed, so that a shell, CI or SLURM sees it;
  preempted or unfinished points exit 0 (re-running resumes them)."""
  if emit == "commands":
    sys.stdout.write(sweep_launch.emit_commands(config_path, config_arg, workdir, overrides,
                                                only))
    return None
  if emit == "slurm":
    sys.stdout.write(sweep_launch.slurm_script(config_path, config_arg, workdir, overrides,
                                               only))
    return None
  if emit is not None:
    raise ValueError(f"--sweep_emit={emit!r}: must be 'commands' or 'slurm'")
  status = run_sweep(config_path, config_arg, workdir, parallel, overrides, only)
  width = max(len(n) for n in status)
  for name, s in status.items():
    print(f"{name:<{width}}  {s}")
  failed = [n for n, s in status.items() if s == "failed"]
  if failed:
    print(failure_summary(workdir, failed))
  print(f"report: python -m experiments.report {workdir}")
  sys.stdout.flush()
  if failed:
    raise SystemExit(1)
  return status

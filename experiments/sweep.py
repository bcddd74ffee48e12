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
experiments/sweep_eval.py), so one training serves many evaluations. A point is finished when its
metrics.jsonl has an eval line at its config's train.steps; finished points are
skipped and unfinished ones resume from their checkpoints, so re-running the
same command continues a sweep. A point that raises (or whose process exits
non-zero) gets `<workdir>/<name>/FAILED` with the traceback and the sweep goes
on; the next run retries it. When any point failed, `main` prints each one's
name, FAILED path and error after the status table and exits 1 (a preempted
point is no failure: exit 0). `<workdir>/sweep.json` records the points.
One process trains the points in turn (multi-host safe); experiments/sweep_launch.py
builds the per-point commands and runs the local pool of `--sweep_parallel`.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import re
import sys
import traceback
from typing import Any, Iterable, Sequence

import ml_collections
from absl import flags as absl_flags
from ml_collections.config_flags import tuple_parser

log = logging.getLogger(__name__)

FAILED = "FAILED"
SWEEP_FILE = "sweep.json"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+=-]*$")
# A traceback's last line, "ValueError: ..." or "jax.errors.SomeError: ...".
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b(:.*)?$")


@dataclasses.dataclass(frozen=True)
class Point:
  name: str
  overrides: dict[str, Any]  # Config path ("model.num_kv_heads") -> value.
  # An evaluation point: the trained point it evaluates (its overrides are that
  # point's plus eval.* ones); it trains nothing (experiments/sweep_eval.py).
  eval_of: str | None = None
  eval_step: int | None = None  # The checkpoint it evaluates (None: the final one).
  # A converted point: made from this trained point's final checkpoint by
  # `--mode convert` (MHA -> GQA), then trained (uptrained) like any point.
  convert_from: str | None = None


# Helpers for config files ----------------------------------------------------


def seeds(n: int) -> range:
  """Seeds 0..n-1 for a sweep's `seeds=n` argument."""
  if not isinstance(n, int) or n < 1:
    raise ValueError(f"seeds={n!r}: must be a positive integer")
  return range(n)


def set_task(config: ml_collections.ConfigDict, task: str) -> None:
  """task=text keeps the config's corpus; task=mqar trains and evaluates on
  synthetic multi-query associative recall (train/mqar.py), where attention
  variants separate clearly even at CPU scale."""
  if task == "mqar":
    config.data.corpus = "mqar"
  elif task != "text":
    raise ValueError(f"task={task!r}: must be 'text' (the config's corpus) or 'mqar'")


# Points and their configs ----------------------------------------------------


def load_module(config_path: str):
  """The config file as a module (as config_flags loads it)."""
  if not os.path.isfile(config_path):
    raise FileNotFoundError(f"config file {config_path!r} not found")
  tag = hashlib.sha1(os.path.abspath(config_path).encode()).hexdigest()[:8]
  spec = importlib.util.spec_from_file_location(f"_sweep_config_{tag}", config_path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def points(config_path: str, arg: str | None) -> list[Point]:
  """The config's sweep points, names checked (unique, usable as directory names)."""
  module = load_module(config_path)
  if not hasattr(module, "sweep"):
    raise ValueError(f"{config_path} defines no sweep(arg): it is a single run, not a sweep")
  out = []
  for i, entry in enumerate(module.sweep(arg)):
    entry = dict(entry)
    name = entry.pop("name", None)
    if not isinstance(name, str) or not _NAME.match(name):
      raise ValueError(f"{config_path}: sweep point {i} has name {name!r}: each point needs "
                       "a 'name' of letters, digits and ._+=- (a directory name)")
    out.append(Point(name, entry, entry.pop("eval_of", None), entry.pop("eval_step", None),
                     entry.pop("convert_from", None)))
  names = [p.name for p in out]
  dupes = sorted({n for n in names if names.count(n) > 1})
  if dupes:
    raise ValueError(f"{config_path}: sweep point names must be unique; repeated: {dupes}")
  if not out:
    raise ValueError(f"{config_path}: sweep({arg!r}) returned no points")
  from experiments import sweep_eval  # pylint: disable=g-import-not-at-top
  return sweep_eval.resolve(config_path, out)


def _node(config: ml_collections.ConfigDict, path: str):
  *parents, leaf = path.split(".")
  node = config
  for i, part in enumerate(parents):
    if part not in node or not isinstance(node[part], ml_collections.ConfigDict):
      raise ValueError(f"config.{path}: no section config.{'.'.join(parents[:i + 1])}")
    node = node[part]
  if leaf not in node:
    raise ValueError(f"config.{path}: no such field (misspelt override?)")
  return node, leaf


def set_value(config: ml_collections.ConfigDict, path: str, value: Any) -> None:
  """config.<path> = value, for an existing field; ValueError naming the field."""
  node, leaf = _node(config, path)
  try:
    node[leaf] = tuple(value) if isinstance(value, list) else value
  except (TypeError, ValueError) as e:
    raise ValueError(f"config.{path}={value!r}: {e}") from None


_PARSERS = {bool: absl_flags.BooleanParser(), int: absl_flags.IntegerParser(),
            float: absl_flags.FloatParser(), str: absl_flags.ArgumentParser(),
            tuple: tuple_parser.TupleParser()}


def _literal(text: str) -> Any:
  try:
    return ast.literal_eval(text.capitalize() if text in ("true", "false") else text)
  except (SyntaxError, ValueError):
    return text


def parse_flags(config: ml_collections.ConfigDict, flags: Iterable[str]) -> dict[str, Any]:
  """`--config.a.b=v` command-line overrides -> {path: value}, each value parsed
  for its field's type the way ml_collections.config_flags parses it."""
  out = {}
  for flag in flags:
    if not flag.startswith("--config."):
      raise ValueError(f"override {flag!r}: expected --config.<path>=<value>")
    path, eq, text = flag[len("--config."):].partition("=")
    node, leaf = _node(config, path)
    kind = node.get_ref(leaf).get_type()
    if not eq:  # `--config.train.tensorboard` alone sets a boolean, as config_flags does.
      if kind is not bool:
        raise ValueError(f"override {flag!r}: expected --config.{path}=<value> (with '=')")
      text = "true"
    parser = _PARSERS.get(kind)
    try:
      out[path] = parser.parse(text) if parser else _literal(text)
    except ValueError as e:
      raise ValueError(f"config.{path}={text!r}: {e}") from None
  return out


def point_config(config_path: str, arg: str | None, point: Point,
                 flags: Sequence[str] = ()) -> ml_collections.ConfigDict:
  """get_config(arg) + the point's overrides + the command line's flags."""
  config = load_module(config_path).get_config(arg)
  for path, value in point.overrides.items():
    set_value(config, path, value)
  for path, value in parse_flags(config, flags).items():
    set_value(config, path, value)
  return config


def is_finished(run_dir: str, steps: int) -> bool:
  """metrics.jsonl holds an eval line at `steps` (the run's last step)."""
  from train.metrics import read_metrics  # pylint: disable=g-import-not-at-top
  return any(r.get("split") == "eval" and r.get("step") == steps for r in read_metrics(run_dir))


# Running ---------------------------------------------------------------------


def _primary() -> bool:
  import jax  # pylint: disable=g-import-not-at-top
  return jax.process_index() == 0


def record_failure(run_dir: str, text: str) -> None:
  if _primary():
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, FAILED), "w") as f:
      f.write(text)


def clear_failure(run_dir: str) -> None:
  path = os.path.join(run_dir, FAILED)
  if _primary() and os.path.exists(path):
    os.remove(path)


def _write_sweep_file(config_path, arg, workdir, flags, pts) -> None:
  if not _primary():
    return
  os.makedirs(workdir, exist_ok=True)
  record = {"config": config_path, "arg": arg, "flags": list(flags),
            "points": [{"name": p.name, "overrides": p.overrides} for p in pts]}
  with open(os.path.join(workdir, SWEEP_FILE), "w") as f:
    json.dump(record, f, indent=2, default=list)


def _pending(config_path, arg, workdir, flags, pts, status) -> list[Point]:
  """Points still to run; finished ones and ones whose config fails are settled."""
  todo = []
  for p in pts:
    run_dir = os.path.join(workdir, p.name)
    try:
      steps = int(point_config(config_path, arg, p, flags).train.steps)
    except Exception:  # pylint: disable=broad-except
      record_failure(run_dir, traceback.format_exc())
      status[p.name] = "failed"
      continue
    if is_finished(run_dir, steps):
      status[p.name] = "skipped"
    else:
      todo.append(p)
  return todo


def _run_in_process(config_path, arg, workdir, flags, todo, status) -> None:
  from train.loop import run  # pylint: disable=g-import-not-at-top
  for i, p in enumerate(todo):
    run_dir = os.path.join(workdir, p.name)
    clear_failure(run_dir)
    log.info("sweep point %s (%d/%d)", p.name, i + 1, len(todo))
    try:
      config = point_config(config_path, arg, p, flags)
      result = run(config, run_dir)
    except Exception:  # pylint: disable=broad-except
      record_failure(run_dir, traceback.format_exc())
      log.error("sweep point %s failed; traceback in %s", p.name, os.path.join(run_dir, FAILED))
      status[p.name] = "failed"
      continue
    if "preempted_at" in result:  # The job is being stopped: leave the rest for the rerun.
      status[p.name] = "preempted"
      for q in todo[i + 1:]:
        status[q.name] = "pending"
      return
    status[p.name] = "done" if is_finished(run_dir, int(config.train.steps)) else "unfinished"


def run_sweep(config_path: str, arg: str | None, workdir: str, parallel: int = 1,
              flags: Sequence[str] = ()) -> dict[str, str]:
  """Runs every unfinished point; returns {name: "done" | "skipped" | "failed" |
  "preempted" | "unfinished" | "pending"} in sweep order. parallel=1 trains in this process
  (multi-host safe); parallel>1 runs that many launch.py processes at a time."""
  if parallel < 1:
    raise ValueError(f"--sweep_parallel={parallel}: must be >= 1")
  pts = points(config_path, arg)
  _write_sweep_file(config_path, arg, workdir, flags, pts)
  status: dict[str, str] = {}
  from experiments import sweep_eval  # pylint: disable=g-import-not-at-top
  evals = [p for p in pts if p.eval_of is not None]
  stages = [[p for p in pts if p.eval_of is None and p.convert_from is None],
            [p for p in pts if p.convert_from is not None]]
  for i, stage in enumerate(stages):
    if i == 1:  # Conversions need their trained sources; "before" evaluations, step 0.
      sweep_eval.run_conversions(config_path, arg, workdir, flags, stage, status,
                                 {p.name: p for p in stages[0]})
      sweep_eval.run_evals(config_path, arg, workdir, flags, evals, status)
    todo = _pending(config_path, arg, workdir, flags, [p for p in stage if p.name not in status],
                    status)
    if parallel == 1:
      _run_in_process(config_path, arg, workdir, flags, todo, status)
    else:
      from experiments import sweep_launch  # pylint: disable=g-import-not-at-top
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
    path = os.path.join(workdir, name, FAILED)
    try:
      with open(path, errors="replace") as f:
        error = last_error(f.read())
    except OSError:  # Another host's process wrote it, or it could not be written.
      error = "(no FAILED file)"
    out.append(f"  {name}: {error}\n    {path}")
  return "\n".join(out)


def main(config_path: str, config_arg: str | None, workdir: str, parallel: int = 1,
         emit: str | None = None, overrides: Sequence[str] = ()) -> dict[str, str] | None:
  """launch.py's --sweep / --sweep_emit entry point. Raises SystemExit(1) after
  printing the status when any point failed, so that a shell, CI or SLURM sees it;
  preempted or unfinished points exit 0 (re-running resumes them)."""
  from experiments import sweep_launch  # pylint: disable=g-import-not-at-top
  if emit == "commands":
    sys.stdout.write(sweep_launch.emit_commands(config_path, config_arg, workdir, overrides))
    return None
  if emit == "slurm":
    sys.stdout.write(sweep_launch.slurm_script(config_path, config_arg, workdir, overrides))
    return None
  if emit is not None:
    raise ValueError(f"--sweep_emit={emit!r}: must be 'commands' or 'slurm'")
  status = run_sweep(config_path, config_arg, workdir, parallel, overrides)
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

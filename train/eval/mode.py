"""`launch.py --mode eval`: evaluate a run's checkpoint, never train.

    python launch.py --mode eval --workdir runs/x                       # latest checkpoint
    python launch.py --mode eval --workdir runs/x --step 200 --config.eval.context_lengths='(1,2,4)'

The run's own config.json is used, with `eval.*` overrides only (anything else
would evaluate a different model than the one trained). Each evaluation appends
one line to `RUN/evals.jsonl` ({"step", "split": "eval", "overrides", "time",
figures}); metrics.jsonl and the checkpoints are never touched, so the report's
training curves stay what training logged.
"""

from __future__ import annotations

import datetime
from typing import Any

import jax

from parallel import mesh_context
from train import checkpoint as ckpt
from train.eval.evaluator import Evaluator
from train.io import runlog, storage
from train.lifecycle import config_record, session
from train.metrics import METRICS_FILE, json_line
from train.spec import parse

EVALS_FILE = "evals.jsonl"


def evaluate_run(workdir: str, step: int | None = None,
                 overrides: dict[str, Any] | None = None, into: str | None = None) -> dict:
  """Evaluates checkpoint `step` (latest that restores when None) with the run's
  config plus `overrides` ({"eval.rope_scaling": "yarn", ...}); records and returns
  {"step", "split", "overrides", "time", **figures}.

  Recorded in RUN/evals.jsonl, or with `into`: as an evaluation run directory of
  its own (a sweep's evaluation point): config.json (the evaluated config; `_run`
  names the source run and step) and metrics.jsonl with this one eval line.
  """
  overrides = dict(overrides or {})
  config = config_record.read_config(workdir)
  for path, value in overrides.items():
    section, _, leaf = path.partition(".")
    if section != "eval" or not leaf or "." in leaf:
      raise ValueError(f"--config.{path}: --mode eval takes only --config.eval.* overrides; "
                       "the model, data and training settings are the run's own")
    if leaf not in config.eval:
      raise ValueError(f"--config.{path}: no such field; eval fields are "
                       f"{sorted(config.eval.keys())}")
    config.eval[leaf] = tuple(value) if isinstance(value, list) else value
  spec = parse(config, jax.device_count())
  s = session.open_run(spec, workdir, "eval")
  manager = ckpt.make_manager(workdir, read_only=True)
  try:
    with mesh_context(s.mesh, s.rules):
      state, _ = ckpt.restore_latest(manager, workdir, s.template, s.shardings, step=step)
  finally:
    manager.close()
  if state is None:
    raise FileNotFoundError(f"no checkpoint restores in {ckpt.checkpoint_dir(workdir)}")
  with mesh_context(s.mesh, s.rules):
    figures = Evaluator(s.model_cfg, spec, s.source, s.mesh, s.rules, s.shardings).run(state)
  record = {"step": int(state.step), "split": "eval", "overrides": overrides,
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **figures}
  if jax.process_index() == 0 and into is None:
    runlog.append(workdir, EVALS_FILE, [json_line(record)])
  elif jax.process_index() == 0:
    _write_eval_run(into, workdir, spec, record)
  return record


def _write_eval_run(into: str, source: str, config, record: dict) -> None:
  """An evaluation's own run directory; never over a directory holding a trained run."""
  found = [c for c in config_record.contents(into) if not c.startswith("config.json")]
  if any(c.startswith("checkpoints") for c in found):
    raise ValueError(f"{into} holds a trained run ({'; '.join(found)}): an evaluation is "
                     "written only into a new directory or an earlier evaluation's")
  environment = {**config_record.environment(), "eval_of": storage.absolute(source),
                 "checkpoint_step": record["step"], "data": session.recorded_data(source)}
  config_record.write_config(into, config, environment)
  runlog.replace(into, METRICS_FILE,
                 [json_line({k: v for k, v in record.items() if k not in ("overrides", "time")})])


def read_evals(workdir: str) -> list[dict]:
  """The `--mode eval` records of a run, in order ([] if none)."""
  return runlog.read_records(workdir, EVALS_FILE)

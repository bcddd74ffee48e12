"""Evaluation points of a sweep: train once, evaluate many.

A sweep point `{"name": "rope-yarn-s0", "eval_of": "rope-s0", "eval.rope_scaling": "yarn",
...}` trains nothing: once `rope-s0` has finished, its final checkpoint is evaluated
with the point's config (the trained point's, plus its `eval.*` overrides and the
command line's flags) into `<workdir>/rope-yarn-s0/`: config.json (recording the
source run and step) and a metrics.jsonl holding that one eval line. The report
reads it as a row like any other. Re-running the sweep skips finished evaluations.
"""

from __future__ import annotations

import logging
import traceback
from typing import Sequence

from experiments.sweep.points import clear_failure, is_finished, point_config, record_failure
from train.io import storage
from train.convert import convert_run
from train.eval.mode import evaluate_run
from train.lifecycle.changes import flatten
from train.lifecycle.config_record import contents

log = logging.getLogger(__name__)


def eval_overrides(config) -> dict:
  """The point's whole eval section, as overrides of the source run's config."""
  return {f"eval.{k}": v for k, v in config.eval.items()}


def run_evals(config_path: str, arg: str | None, workdir: str, flags: Sequence[str],
              evals: list, status: dict) -> None:
  for p in evals:
    if status.get(p.name, "pending") != "pending":  # Settled by an earlier pass of this run.
      continue
    run_dir = storage.join(workdir, p.name)
    src_dir = storage.join(workdir, p.eval_of)
    try:
      config = point_config(config_path, arg, p, flags)
      steps = int(config.train.steps)
      step = steps if p.eval_step is None else int(p.eval_step)
      if is_finished(run_dir, step):
        status[p.name] = "skipped"
        continue
      ready = (storage.isdir(storage.join(src_dir, "checkpoints", str(step))) if step != steps
               else is_finished(src_dir, steps))
      if not ready:
        status[p.name] = "pending"  # Its source is not there yet: a later run.
        continue
      clear_failure(run_dir)
      log.info("sweep point %s: evaluating %s at step %d", p.name, src_dir, step)
      evaluate_run(src_dir, step, eval_overrides(config), into=run_dir)
      status[p.name] = "done"
    except Exception:  # pylint: disable=broad-except
      record_failure(run_dir, traceback.format_exc())
      status[p.name] = "failed"


def run_conversions(config_path: str, arg: str | None, workdir: str, flags: Sequence[str],
                    converted: list, status: dict, sources: dict) -> None:
  """Converts each converted point's source (its final checkpoint) into the point's
  directory, once: the point then trains (uptrains) from that step-0 run.
  `sources`: name -> Point of the sweep's trained points."""
  for p in converted:
    run_dir = storage.join(workdir, p.name)
    src_dir = storage.join(workdir, p.convert_from)
    try:
      config = point_config(config_path, arg, p, flags)
      if contents(run_dir):
        continue  # Converted by an earlier run: training resumes it.
      src_config = point_config(config_path, arg, sources[p.convert_from], flags)
      if not is_finished(src_dir, int(src_config.train.steps)):
        status[p.name] = "pending"
        continue
      old = flatten(src_config.to_dict())
      changed = {path: v for path, v in flatten(config.to_dict()).items() if old.get(path) != v}
      log.info("sweep point %s: converting %s", p.name, src_dir)
      convert_run(src_dir, run_dir, changed, "mean")
    except Exception:  # pylint: disable=broad-except
      record_failure(run_dir, traceback.format_exc())
      status[p.name] = "failed"

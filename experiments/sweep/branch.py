"""Decay branches in a sweep: one stable run per variant and seed, many token budgets.

A point `{"name": "kv4-b200-s0", "branch_of": "kv4-s0", "train.steps": 200}` of a
sweep whose points train with `train.schedule="wsd"` trains only its cooldown: once
`kv4-s0` (say 800 steps) has finished, its checkpoint at the branch's cooldown start
(200 - decay_fraction * 200) is copied into `<workdir>/kv4-b200-s0/` (train/branch.py)
and the branch trains from there to step 200 like any point, so re-running resumes
or skips it. The source keeps those checkpoints: `with_keep_steps` adds each of its
branches' start steps to its `train.keep_steps` before anything trains.
"""

from __future__ import annotations

import dataclasses
import logging
import traceback
from typing import Sequence

from experiments.sweep.points import is_finished, point_config, record_failure
from train.io import storage
from train.branch import branch_run
from train.lifecycle.config_record import read_record
from train.optim import decay_start

log = logging.getLogger(__name__)


def with_keep_steps(config_path: str, arg: str | None, flags: Sequence[str],
                    pts: list) -> list:
  """The points, each branch source with its branches' start steps in train.keep_steps."""
  starts: dict[str, set[int]] = {}
  for p in pts:
    if p.branch_of is None:
      continue
    try:
      config = point_config(config_path, arg, p, flags)
    except Exception:  # pylint: disable=broad-except
      continue  # The branch's own config is broken: its run reports that (FAILED).
    starts.setdefault(p.branch_of, set()).add(decay_start(config.train))
  out = []
  for p in pts:
    if p.name in starts:
      keep = tuple(p.overrides.get("train.keep_steps") or ())
      p = dataclasses.replace(p, overrides={
          **p.overrides, "train.keep_steps": tuple(sorted(set(keep) | starts[p.name]))})
    out.append(p)
  return out


def run_branches(config_path: str, arg: str | None, workdir: str, flags: Sequence[str],
                 branches: list, status: dict, sources: dict) -> None:
  """Creates each branch's run directory from its finished source, once; the branch
  then trains (its cooldown) as a point. `sources`: name -> Point (trained points)."""
  for p in branches:
    run_dir = storage.join(workdir, p.name)
    src_dir = storage.join(workdir, p.branch_of)
    try:
      config = point_config(config_path, arg, p, flags)
      if read_record(run_dir) is not None:  # Written last: the branch is whole.
        continue  # Branched by an earlier run: training resumes or skips it.
      src_config = point_config(config_path, arg, sources[p.branch_of], flags)
      if not is_finished(src_dir, int(src_config.train.steps)):
        status[p.name] = "pending"
        continue
      log.info("sweep point %s: branching from %s", p.name, src_dir)
      branch_run(src_dir, run_dir, config)
    except Exception:  # pylint: disable=broad-except
      record_failure(run_dir, traceback.format_exc())
      status[p.name] = "failed"

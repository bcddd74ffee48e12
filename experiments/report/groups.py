"""Grouping a report's runs over seeds: the groups of summary.csv and the tables.

A group is the finished runs that agree on every swept field and on their name but
for its seed suffix. Its `n` is its runs; each metric carries its own count,
<metric>_n, the runs that measured it (a task scored on one seed of three has n 1
there), with <metric>_mean and _std over those runs only (no std from one value).
Each run's value by seed (`_obs`, and `_values` in run order) feeds stats.py's
comparison with the baseline.
"""

from __future__ import annotations

import json
import os
import re
import statistics

from experiments.report import stats as report_stats
from experiments.report.notes import finite
from train.lifecycle.changes import is_operational

_SEED_SUFFIX = re.compile(r"[-_]s(eed)?\d+$")


def _label(rows: list[dict], fields: list[str]) -> str:
  """Run name without its seed suffix when the group's runs agree on it."""
  names = {_SEED_SUFFIX.sub("", os.path.basename(r["run"])) for r in rows}
  if len(names) == 1:
    return names.pop()
  return ", ".join(f"{f.split('.')[-1]}={rows[0][f]}" for f in fields) or "all"


def _seed_key(r: dict, i: int):
  """The run's seed, what pairs it with the baseline's run of the same seed; its position
  when the seed is missing."""
  return r.get("seed") if r.get("seed") is not None else f"#{i}"


def group_rows(rows: list[dict], fields: list[str], metrics: list[str]) -> list[dict]:
  """Finished runs grouped by the swept fields: label, fields, n, <m>_mean, <m>_std,
  <m>_n. Runs with a reason under `excluded` (e.g. a non-finite final loss) are left out."""
  groups: dict[str, list[dict]] = {}
  for r in rows:
    if r["status"] == "finished" and not r.get("excluded"):
      # Same fields and the same name but for the seed suffix: an uptrained run and
      # the evaluation of its conversion share their config, not their name.
      name = _SEED_SUFFIX.sub("", os.path.basename(r["run"]))
      groups.setdefault(json.dumps([name] + [r[f] for f in fields], default=str),
                        []).append(r)
  out = []
  for members in groups.values():
    g = {"label": _label(members, fields), **{f: members[0][f] for f in fields},
         "n": len(members), "_values": {}, "_obs": {}}
    seeds = [_seed_key(r, i) for i, r in enumerate(members)]
    if len(set(seeds)) < len(seeds):  # Two runs of one seed: pair by position instead.
      seeds = [f"#{i}" for i in range(len(members))]
    for m in metrics:
      obs = [(s, v) for s, r in zip(seeds, members) if (v := finite(r.get(m))) is not None]
      values = [v for _, v in obs]
      g["_values"][m], g["_obs"][m] = values, obs
      g[f"{m}_mean"] = statistics.fmean(values) if values else None
      g[f"{m}_std"] = statistics.stdev(values) if len(values) > 1 else None
      g[f"{m}_n"] = len(values)
    out.append(g)
  report_stats.add_significance(out, fields, metrics)
  return out


def summary_columns(fields: list[str], metrics: list[str]) -> list[str]:
  """summary.csv's columns (and load_results(groups=True)'s)."""
  stats = [f"{m}_{s}" for m in metrics for s in ("mean", "std", "n")]
  return ["label", *fields, "n", *stats, *report_stats.columns(metrics)]


def table_fields(fields: list[str]) -> list[str]:
  """The swept fields the tables show: train.steps, and no other operational one
  (cadences, kept steps: a ladder's sizes sweep them along); the csv files keep all."""
  return [f for f in fields if f == "train.steps" or not is_operational(f)]

"""A sweep's points and their configs: the base the sweep modules share.

experiments/sweep/__init__.py runs the points, experiments/sweep/eval.py evaluates and
converts, experiments/sweep/launch.py turns points into processes; each imports
this module and none imports another's caller (no cycle). Config files reach
these helpers as `experiments.sweep.seeds`, `.set_task` (re-exported there).
"""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
import hashlib
import importlib.util
import os
import re
from typing import Any, Iterable, Sequence

import ml_collections
from absl import flags as absl_flags
from ml_collections.config_flags import tuple_parser

from train.io import storage
from train.lifecycle.changes import is_operational
from train.metrics import read_metrics
from train.spec import parse

FAILED = "FAILED"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+=-]*$")


@dataclasses.dataclass(frozen=True)
class Point:
  name: str
  overrides: dict[str, Any]  # Config path ("model.num_kv_heads") -> value.
  # An evaluation point: the trained point it evaluates (its overrides are that
  # point's plus eval.* ones); it trains nothing (experiments/sweep/eval.py).
  eval_of: str | None = None
  eval_step: int | None = None  # The checkpoint it evaluates (None: the final one).
  # A converted point: made from this trained point's final checkpoint by
  # `--mode convert` (MHA -> GQA), then trained (uptrained) like any point.
  convert_from: str | None = None
  # A decay branch: starts from this trained wsd point's stable-phase checkpoint and
  # trains only its own cooldown (train/branch.py); it may change only operational
  # fields (train.steps: the shorter token budget; cadences).
  branch_of: str | None = None


# Helpers for config files ----------------------------------------------------


def seeds(n: int) -> range:
  """Seeds 0..n-1 for a sweep's `seeds=n` argument."""
  if not isinstance(n, int) or n < 1:
    raise ValueError(f"seeds={n!r}: must be a positive integer")
  return range(n)


def set_task(config: ml_collections.ConfigDict, task: str) -> None:
  """task=text keeps the config's corpus; task=mqar trains and evaluates on
  synthetic multi-query associative recall (train/data/mqar.py); gqa_ablation.py then
  applies experiments/configs/mqar_task.py, under which it is learnable on a CPU."""
  if task == "mqar":
    config.data.corpus = "mqar"
  elif task != "text":
    raise ValueError(f"task={task!r}: must be 'text' (the config's corpus) or 'mqar'")


# Points ----------------------------------------------------------------------


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
                     entry.pop("convert_from", None), entry.pop("branch_of", None)))
  names = [p.name for p in out]
  dupes = sorted({n for n in names if names.count(n) > 1})
  if dupes:
    raise ValueError(f"{config_path}: sweep point names must be unique; repeated: {dupes}")
  if not out:
    raise ValueError(f"{config_path}: sweep({arg!r}) returned no points")
  return resolve(config_path, out)


def select(pts: list[Point], only: Sequence[str] | None) -> list[Point]:
  """The points whose names match one of `only` (names or globs: "rope", "kv*-s0"), in
  the sweep's order; all of them when `only` is None. A pattern matching no point is
  refused, naming the points there are."""
  if only is None:
    return pts
  patterns = [o.strip() for o in only if o.strip()]
  unmatched = [o for o in patterns if not any(fnmatch.fnmatchcase(p.name, o) for p in pts)]
  if not patterns or unmatched:
    raise ValueError(f"--sweep_only={','.join(only)}: {', '.join(map(repr, unmatched)) or 'no'} "
                     f"pattern matches no point; the points are {', '.join(p.name for p in pts)}")
  return [p for p in pts if any(fnmatch.fnmatchcase(p.name, o) for o in patterns)]


def resolve(config_path: str, pts: list[Point]) -> list[Point]:
  """Checks each evaluation point (its source is a trained point; it overrides only
  `eval.*`) and gives it the source's overrides under its own; orders the points
  trained, then converted, then evaluation (the order they can run in)."""
  by_name = {p.name: p for p in pts}
  out = []
  for p in pts:
    if p.branch_of is not None:
      out.append(_resolve_branch(config_path, p, by_name.get(p.branch_of)))
      continue
    if p.eval_of is None:
      out.append(p)
      continue
    src = by_name.get(p.eval_of)
    if src is None or src.eval_of is not None:
      raise ValueError(f"{config_path}: point {p.name!r} has eval_of={p.eval_of!r}, which is "
                       "not a trained point of this sweep")
    bad = sorted(k for k in p.overrides if not k.startswith("eval."))
    if bad:
      raise ValueError(f"{config_path}: evaluation point {p.name!r} overrides {bad}: an "
                       "evaluation may change only eval.* fields (the model is its source's)")
    out.append(Point(p.name, {**src.overrides, **p.overrides}, p.eval_of, p.eval_step))
  for p in out:
    if p.convert_from is not None and by_name.get(p.convert_from, p).convert_from is not None:
      raise ValueError(f"{config_path}: point {p.name!r} has convert_from={p.convert_from!r}, "
                       "which is not a trained (unconverted) point of this sweep")
  rank = lambda p: (2 if p.eval_of is not None else
                    1 if p.convert_from is not None or p.branch_of is not None else 0)
  return sorted(out, key=rank)


def _resolve_branch(config_path: str, p: Point, src: Point | None) -> Point:
  """A decay branch with its source's overrides under its own (operational ones only)."""
  if src is None or src.eval_of or src.convert_from or src.branch_of:
    raise ValueError(f"{config_path}: point {p.name!r} has branch_of={p.branch_of!r}, which "
                     "is not a trained point of this sweep")
  bad = sorted(k for k in p.overrides if not is_operational(k))
  if bad:
    raise ValueError(f"{config_path}: decay branch {p.name!r} overrides {bad}: a branch "
                     "continues its source's run and may change only train.steps and cadences")
  return dataclasses.replace(p, overrides={**src.overrides, **p.overrides})


# A point's config --------------------------------------------------------------


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


def check_points(config_path: str, arg: str | None, pts: Sequence[Point],
                 flags: Sequence[str] = ()) -> None:
  """Builds and validates (train/spec, as the trainer does) every point's config;
  raises one ValueError naming each invalid point and its error, points that share an
  error together, so a sweep refuses before it trains (or writes) anything."""
  import jax  # pylint: disable=g-import-not-at-top
  errors: dict[str, list[str]] = {}
  for p in pts:
    try:
      parse(point_config(config_path, arg, p, flags), jax.device_count())
    except (ValueError, TypeError, KeyError, OSError) as e:
      errors.setdefault(" ".join(str(e).split()) or type(e).__name__, []).append(p.name)
  if errors:
    bad = sum(len(v) for v in errors.values())
    said = "; ".join(f"{', '.join(names)}: {why}" for why, names in errors.items())
    raise ValueError(f"{bad} of {len(pts)} sweep points are invalid, nothing was trained "
                     f"(fix the config or its overrides and re-run): {said}")


# A point's run directory -------------------------------------------------------


def is_finished(run_dir: str, steps: int) -> bool:
  """metrics.jsonl holds an eval line at `steps` (the run's last step)."""
  return any(r.get("split") == "eval" and r.get("step") == steps for r in read_metrics(run_dir))


def final_figures(run_dir: str) -> str:
  """" (eval loss 2.0060, bpb 2.8941, bpb/man 2.7012)": a finished point's last eval
  line, for the sweep's progress line; "" when it logged none."""
  evals = [r for r in read_metrics(run_dir, warn=False) if r.get("split") == "eval"]
  if not evals:
    return ""
  shown = [(k, v) for k, v in evals[-1].items()
           if (k in ("loss", "bpb", "accuracy") or k.startswith("bpb/"))
           and isinstance(v, (int, float)) and not isinstance(v, bool)]
  return " (eval " + ", ".join(f"{k} {v:.4f}" for k, v in shown) + ")" if shown else ""


def primary() -> bool:
  import jax  # pylint: disable=g-import-not-at-top
  return jax.process_index() == 0


def record_failure(run_dir: str, text: str) -> None:
  if primary():
    storage.write_text(storage.join(run_dir, FAILED), text)


def clear_failure(run_dir: str) -> None:
  if primary():
    storage.delete(storage.join(run_dir, FAILED))

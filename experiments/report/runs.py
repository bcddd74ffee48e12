"""Reading runs: every run directory under a root -> one row per run (results.csv's),
its swept fields and the columns; `load_results` is the same as a pandas DataFrame.
The package (experiments/report/__init__.py) re-exports these and writes the files."""

from __future__ import annotations

import functools
import json
import math
import statistics
from typing import Any

import jax

from experiments.report import fits, notes, sensitivity, tasks
from experiments.report.groups import group_rows, summary_columns
from experiments.report.notes import finite
from model import ModelConfig
from model.decode.cache import kv_bytes_per_token
from model.flops import matmul_params_per_token
from model.transformer import abstract_variables
from train.io import storage
from train.data.named import named_paths
from train.io.jsonfile import read_json_object
from train.lifecycle import changes
from train.lifecycle.lock import live_holder
from train.metrics import read_metrics
from train.spec import derived_vocab_size

METRICS = ("final_loss", "best_loss", "final_bpb", "best_bpb", "accuracy", "tokens", "flops",
           "tokens_per_s", "mfu", "params", "active_params", "kv_bytes_per_token", "moe_maxvio")
DOMAIN_PREFIX = "bpb/"  # Final bits per byte of each named eval corpus: one column each.

def find_runs(root: str) -> list[str]:
  """Run directories (holding config.json, or a sweep's FAILED) at or under `root`."""
  if not storage.isdir(root):
    raise FileNotFoundError(f"{root!r} is not a directory")
  out = []
  for here, dirs, files in storage.walk(root):
    dirs[:] = sorted(d for d in dirs if d not in ("checkpoints", "tensorboard", "report")
                     and not d.endswith(".parts"))  # A bucket's log segments (train/io/runlog.py).
    if "config.json" in files or "FAILED" in files:  # A sweep point may fail before config.json.
      out.append(here)
      dirs[:] = []  # A run's own subdirectories hold no runs.
  return sorted(out)


@functools.lru_cache(maxsize=None)
def _model_sizes(model_json: str) -> tuple[int | None, int | None, int | None]:
  """(parameters, active (matmul) parameters per token, KV-cache bytes per token)."""
  try:
    cfg = ModelConfig.from_dict(json.loads(model_json))
  except (TypeError, ValueError):
    return None, None, None
  try:
    # The decode cache's own shapes (GQA keys and values, MLA latent rows), one formula.
    kv = kv_bytes_per_token(cfg)
  except Exception:  # pylint: disable=broad-except
    kv = None
  try:
    shapes = abstract_variables(cfg)["params"]
    params = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
  except Exception:  # pylint: disable=broad-except
    params = None  # A model this checkout cannot build (e.g. newer fields): leave it blank.
  return params, matmul_params_per_token(cfg), kv


def _median(values: list[float]) -> float | None:
  values = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
  return statistics.median(values) if values else None


def summarize_run(run_dir: str) -> tuple[dict[str, Any], dict[str, Any]]:
  """(flattened config, summary row) of one run directory."""
  record, damaged = _read_record(run_dir)
  if damaged:  # No config to read: the run is listed, excluded with the reason.
    return {}, {"status": "damaged", "step": 0, "excluded": damaged}
  environment = record.pop("_run", None) or {}
  config = changes.flatten(record, sequence=tuple)
  records = read_metrics(run_dir)
  evals = [r for r in records if r.get("split") == "eval" and "loss" in r]
  train = [r for r in records if r.get("split") == "train"]
  steps = config.get("train.steps")
  if "eval_of" in environment:  # An evaluation point: finished at the step it evaluated.
    steps = environment.get("checkpoint_step", steps)
  finished = any(r.get("step") == steps for r in evals)
  holder = live_holder(run_dir)  # Its trainer still runs (an orphan, another job's point).
  failed = storage.exists(storage.join(run_dir, "FAILED"))  # Even with complete metrics.
  row: dict[str, Any] = {
      "status": ("running" if holder else "failed" if failed else
                 "finished" if finished else "unfinished"),
      "step": max((r.get("step", 0) for r in records), default=0),
      "_holder": holder, "_complete": finished, "_seq_len": config.get("data.seq_len"),
      "_mixture_share": (environment.get("data") or {}).get("mixture_share"),
  }
  maxvio = None
  if evals:
    row.update(_eval_metrics(evals, config.get("data.seq_len") or 0))
    row.update(tasks.run_figures(run_dir, evals[-1], config.get("data.seq_len") or 0))
    maxvio = finite(evals[-1].get("moe_maxvio_global"))
  if maxvio is None and train:
    maxvio = finite(train[-1].get("moe_maxvio"))
  row["moe_maxvio"] = maxvio
  row["_init_loss"] = sensitivity.init_loss(evals)  # lr sensitivity's loss at init.
  row["tokens"] = tokens_spent(run_dir)
  row["flops"] = None
  row["tokens_per_s"] = _median([r.get("tokens_per_s") for r in train])
  row["mfu"] = _median([r.get("mfu") for r in train])
  model = {k[len("model."):]: v for k, v in config.items() if k.startswith("model.")}
  if model and model.get("vocab_size") is None:  # Unset: the tokenizer's.
    model["vocab_size"] = derived_vocab_size(record.get("data") or {})
  row["_vocab_size"] = model.get("vocab_size") if model else None
  row["params"], row["active_params"], row["kv_bytes_per_token"] = _model_sizes(
      json.dumps(model, sort_keys=True, default=list)) if model else (None, None, None)
  if model and row["tokens"] and config.get("data.seq_len"):
    row["flops"] = fits.training_flops(json.dumps(model, sort_keys=True, default=list),
                                       int(config["data.seq_len"]), row["tokens"])
  row.update(notes.run_notes(run_dir, row, steps, records, evals))
  try:  # Out-of-domain corpora, marked in the tables (not a results.csv column).
    row["_eval_corpora"] = list(named_paths(config.get("eval.corpora") or "", "eval.corpora"))
  except ValueError:
    row["_eval_corpora"] = []
  return config, row


def _read_record(run_dir: str) -> tuple[dict, str | None]:
  """(config.json's record, None), or ({}, why) when the file is not a JSON object."""
  path = storage.join(run_dir, "config.json")
  try:
    return (read_json_object(path), None) if storage.exists(path) else ({}, None)
  except (OSError, ValueError) as e:
    return {}, f"damaged: {e}"


def tokens_spent(run_dir: str, step: int | None = None) -> int | None:
  """Training tokens behind a run's model (at `step`): its own train lines' tokens_seen,
  plus its source's for a converted (uptrained) run; an evaluation point counts the
  run it evaluated. None when nothing was logged."""
  try:
    environment = json.loads(storage.read_text(storage.join(run_dir, "config.json"))).get(
        "_run") or {}
  except (OSError, ValueError, RecursionError, AttributeError):
    return None
  if "eval_of" in environment:
    return tokens_spent(environment["eval_of"], environment.get("checkpoint_step"))
  seen = [r.get("tokens_seen") for r in read_metrics(run_dir, warn=False)
          if r.get("split") == "train" and (step is None or r.get("step", 0) <= step)]
  own = seen[-1] if seen and isinstance(seen[-1], int) else 0
  if "converted_from" in environment:
    source = tokens_spent(environment["converted_from"], environment.get("source_step"))
    return (source or 0) + own
  return own or None


def _eval_metrics(evals: list[dict], seq_len: int) -> dict[str, Any]:
  """Final and best eval metrics; non-finite values (logged as null) count as missing."""
  last = evals[-1]
  best = lambda m: min((v for r in evals if (v := finite(r.get(m))) is not None), default=None)
  out = {"final_loss": finite(last["loss"]), "best_loss": best("loss"),
         "final_bpb": finite(last.get("bpb")), "best_bpb": best("bpb"),
         "accuracy": finite(last.get("accuracy"))}
  out.update({k: finite(v) for k, v in last.items() if k.startswith(DOMAIN_PREFIX)})
  for key, value in last.items():
    m = notes.at_length(key)
    if m is None or m.relative or m.stat:
      continue
    if seq_len and m.n % seq_len == 0:
      key = f"{m.metric}@{m.n // seq_len}L"
    out[key] = finite(value)
  return out


def swept_fields(configs: list[dict[str, Any]]) -> list[str]:
  """Config paths whose values differ between runs (the seed is reported apart)."""
  configs = [c for c in configs if c]  # A point that failed before writing its config.
  keys = sorted(set().union(*configs)) if configs else []
  key = lambda v: json.dumps(v, sort_keys=True, default=str)
  return [k for k in keys if k != "train.seed" and len({key(c.get(k)) for c in configs}) > 1]


def _sweep_order(root: str):
  """Sort key: the sweep's own point order (sweep.json), then names."""
  try:
    names = [p["name"] for p in json.loads(storage.read_text(storage.join(root, "sweep.json")))[
        "points"]]
  except (OSError, ValueError, KeyError, TypeError):
    names = []
  rank = {n: i for i, n in enumerate(names)}
  return lambda run: (rank.get(storage.relpath(run, root), len(rank)), run)


def _context_key(column: str) -> tuple:
  m = notes.at_length(column)
  return ({"loss": 0, "bpb": 1, "accuracy": 2}[m.metric], not m.relative, m.n)


def collect(root: str) -> tuple[list[str], list[dict[str, Any]], list[str]]:
  """(columns, one row per run, swept fields) for every run under `root`."""
  runs = find_runs(root)
  if not runs:
    raise FileNotFoundError(f"no run directories (with config.json or FAILED) under {root!r}")
  runs.sort(key=_sweep_order(root))
  summaries = [summarize_run(r) for r in runs]
  fields = swept_fields([c for c, _ in summaries])
  rows = []
  for run_dir, (config, summary) in zip(runs, summaries):
    name = storage.relpath(run_dir, root)
    rows.append({"run": "." if name == "." else name, **{f: config.get(f) for f in fields},
                 "seed": config.get("train.seed"), **summary})
  at = sorted({k for r in rows for k in r if notes.at_length(k)}, key=_context_key) + sorted(
      {k for r in rows for k in r if k.startswith(DOMAIN_PREFIX)})  # Then bpb/<corpus>.
  present = [m for m in METRICS if any(r.get(m) is not None for r in rows)]
  columns = ["run", *fields, "seed", "status", "step", *present, *at,
             *tasks.columns(rows), *notes.COLUMNS]
  return columns, rows, fields


def load_results(root: str, groups: bool = False):
  """Every run under `root` as a pandas DataFrame, one row per run and the columns of
  results.csv (run, the swept fields, seed, status, step, metrics), for notebooks:

    df = load_results("runs/gqa")
    df[df.status == "finished"].groupby("model.num_kv_heads").final_loss.agg(["mean", "std"])

  `groups=True`: summary.csv's rows instead (finished runs grouped over seeds:
  <metric>_mean, _std, n, and each group's difference to its baseline with its 95%
  interval, p and the few-seeds flag: experiments/report/stats.py).
  """
  try:
    import pandas as pd  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError("load_results needs pandas: pip install -e '.[report]'") from e
  columns, rows, fields = collect(root)
  if groups:
    metrics = [c for c in columns[columns.index("step") + 1:] if c not in notes.COLUMNS]
    rows, columns = group_rows(rows, fields, metrics), summary_columns(fields, metrics)
  return pd.DataFrame([{c: r.get(c) for c in columns} for r in rows], columns=columns)


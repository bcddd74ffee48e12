"""The run's record: config.json (the resolved config, plus `_run`: the code, JAX and
devices it ran with), and `contents`, what a directory already holds, so that a
writer (a trainer, an import, a conversion, an evaluation) can refuse to overwrite a
run and say what it found.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import jax
import ml_collections

from model.attention.impls import resolve_attention_impl
from model.moe.dispatch import strategies_run
from parallel.mesh import mesh_shape
from train import spec as spec_lib
from train.io import storage
from train.metrics import read_metrics
from train.spec import RunSpec

CONFIG_FILE = "config.json"


def _jsonable(x: Any) -> Any:
  if isinstance(x, dict):
    return {k: _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  return x


def git_commit() -> str | None:
  here = os.path.dirname(os.path.abspath(__file__))
  try:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                         text=True, timeout=5, check=False)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                           capture_output=True, text=True, timeout=5, check=False)
  except (OSError, subprocess.SubprocessError):
    return None
  if out.returncode:
    return None
  return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def environment(spec: RunSpec | None = None) -> dict:
  """The code, JAX and devices a run ran with (config.json's `_run`); with the run's
  spec, also the attention implementation "auto" resolves to at each evaluated
  length (model/attention/impls.py resolve_attention_impl) and, for an MoE model, the
  dispatch strategy training and evaluation run (model/moe/dispatch.py strategies_run):
  facts of the run."""
  record = {"git_commit": git_commit(), "jax_version": jax.__version__,
            "device_kind": jax.devices()[0].device_kind, "device_count": jax.device_count(),
            "process_count": jax.process_count()}
  if spec is not None:
    cfg, seq_len = spec.model, int(spec.data.seq_len)
    lengths = sorted({int(m * seq_len) for m in spec.eval.context_lengths} | {seq_len})
    shape = mesh_shape(spec.mesh.sizes(), jax.device_count())
    record["attention_impl"] = {
        str(n): resolve_attention_impl(cfg, jax.default_backend(), n, context=shape["context"])
        for n in lengths}
    if cfg.num_experts:  # What moe_dispatch ran ("auto" picks by the mesh and the factor).
      record["moe_dispatch"] = strategies_run(cfg, jax.device_count() == 1, shape["expert"])
  return record


def write_config(workdir: str, spec: RunSpec, environment_record: dict | None = None) -> None:
  """config.json: the resolved config (`spec.record`) plus `_run`, the environment the run
  started in (a resume keeps it; what changed since is in config_changes.jsonl)."""
  if jax.process_index() != 0:
    return
  storage.makedirs(workdir)
  record = _jsonable(dict(spec.record))
  record["_run"] = environment_record or environment()
  # Whole or not at all: tmp + rename locally, one PUT on a bucket.
  storage.write_text(storage.join(workdir, CONFIG_FILE),
                     json.dumps(record, indent=2, sort_keys=True))


def read_record(workdir: str) -> dict | None:
  """config.json as written (with `_run`), or None when the directory has none."""
  path = storage.join(workdir, CONFIG_FILE)
  try:
    return json.loads(storage.read_bytes(path))
  except FileNotFoundError:
    return None
  except ValueError as e:
    raise ValueError(f"{path} is not valid JSON ({e}): the run's record is damaged; "
                     "restore it from a backup or start a new --workdir") from None


def read_config(workdir: str) -> ml_collections.ConfigDict:
  """The run's resolved config: config.json read through the spec (train/spec/parse.py
  `read`), so a run recorded before a field existed has it at what it meant then."""
  return read_spec(workdir).config()


def read_spec(workdir: str) -> RunSpec:
  """The run's spec, read from config.json (unchecked: the run's own settings)."""
  record = read_record(workdir)
  if record is None:
    raise FileNotFoundError(f"{storage.join(workdir, CONFIG_FILE)} not found: {workdir!r} is "
                            "not a blockwork run directory")
  return spec_lib.read(record)


def contents(workdir: str) -> list[str]:
  """Human-readable items that make `workdir` a run ([] for a new or empty directory)."""
  found = []
  if storage.exists(storage.join(workdir, CONFIG_FILE)):
    found.append(CONFIG_FILE)
  records = read_metrics(workdir, warn=False)
  if records:
    found.append(f"metrics.jsonl with {len(records)} lines up to step "
                 f"{max(r.get('step', 0) for r in records)}")
  steps = sorted(int(n) for n in storage.listdir(storage.join(workdir, "checkpoints"))
                 if n.isdigit())
  if steps:
    found.append(f"checkpoints at steps {steps}")
  return found

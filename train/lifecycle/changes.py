"""Config changes on resume: a resumed run whose config differs from config.json is
refused unless the change is deliberate (train/lifecycle/resume.py); deliberate
changes, and the code or devices changing under a run, are appended to
`RUN/config_changes.jsonl` with their step.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

from model.config import MOE_DISPATCH_ALIASES
from train.io import runlog

CHANGES_FILE = "config_changes.jsonl"

# Fields that change how a run is operated, not what it computes: they may change
# on resume without a flag (and are still recorded). `train.steps` is here because
# raising it is how a run is continued.
OPERATIONAL = frozenset({
    "name", "train.steps", "train.log_every", "train.eval_every", "train.checkpoint_every",
    "train.keep_checkpoints", "train.keep_every", "train.keep_steps", "train.async_checkpoint",
    "train.lock_lease_s", "train.local_checkpoint_every", "train.local_checkpoint_dir",
    "train.tensorboard", "train.on_nonfinite", "data.worker_count", "hardware.peak_flops",
    "train.profile_steps", "train.profile_start", "train.wandb_project",
    "train.telemetry",  # What is logged, not what is trained (tests/train/test_telemetry.py).
    # Failure handling, as train.on_nonfinite (train/spikes.py).
    "train.spike_threshold", "train.spike_window", "train.on_spike",
    # Token chunks of the loss: each token's loss is computed alone, so any chunking gives
    # the same numbers (tests/train/test_loss.py).
    "model.loss_chunks",
    # The pipeline's microbatches: the same step, sums in another order (as the mesh;
    # tests/parallel/test_pipeline.py).
    "train.pipeline_microbatches", "train.pipeline_schedule", "train.pipeline_stash",
    # The circular schedule's repeats: the same step; checkpoints hold layer order
    # (train/state.py PipelineOrder; tests/parallel/test_pipeline_circular.py).
    "train.pipeline_repeats",
    "model.scan_unroll",  # The same parameters and numbers (tests/model/test_transformer.py).
    # Blockwise attention's blocks: the same function, sums in another order (equal to
    # the reference within float tolerance: tests/model/test_attention_impl.py).
    "model.attention_block_q", "model.attention_block_kv",
    "eval.corpora",  # More (or fewer) corpora evaluated apart; the headline eval is the same.
    "eval.at_start",  # Whether step 0 was evaluated: the trained run is the same.
})
OPERATIONAL_PREFIXES = ("mesh.",)  # Restores reshard; results agree across meshes (tested).


def _now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def flatten(d: dict, prefix: str = "", sequence: type = list) -> dict[str, Any]:
  """{"model": {"d_model": 64}} -> {"model.d_model": 64}; lists and tuples become
  `sequence` (list: as JSON has them; tuple: hashable, printed like the config)."""
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(flatten(v, f"{prefix}{k}.", sequence))
    else:
      out[f"{prefix}{k}"] = sequence(v) if isinstance(v, (list, tuple)) else v
  return out


# field: {old value: the value it now has}; the model's own aliases (model/config.py).
RENAMED_VALUES = {"model.moe_dispatch": MOE_DISPATCH_ALIASES}


def _renamed(flat: dict) -> dict:
  return {f: RENAMED_VALUES[f].get(v, v) if f in RENAMED_VALUES and isinstance(v, str) else v
          for f, v in flat.items()}


def is_operational(field: str) -> bool:
  return field in OPERATIONAL or field.startswith(OPERATIONAL_PREFIXES)


def config_changes(saved: dict, current: dict) -> list[dict]:
  """[{field, old, new}] for every flattened field whose JSON value differs.

  A field that one side lacks (the code gained or lost a field) has old/new None. An old
  name of a value (RENAMED_VALUES) equals the new one: a run configured with it resumes.
  """
  a, b = _renamed(flatten(saved)), _renamed(flatten(current))
  a.pop("_run", None)
  key = lambda v: json.dumps(v, sort_keys=True)
  return [{"field": f, "old": a.get(f), "new": b.get(f)} for f in sorted(set(a) | set(b))
          if not f.startswith("_run.") and key(a.get(f)) != key(b.get(f))]


def environment_changes(saved: dict, current: dict) -> list[dict]:
  """Code or device changes between the run's start (`_run`) and now: facts a reader
  of the results should see (a resume under another commit), never refused."""
  # Only what both record: provenance in `_run` (converted_from, eval_of...) is not
  # environment, and a fact an older run did not record has no old value to compare.
  return [{"field": f"_run.{k}", "old": saved[k], "new": current[k]}
          for k in sorted(current) if k in saved and saved[k] != current[k]]


def tokens_seen_at(workdir: str, step: int, tokens_per_step: int) -> int:
  """Training tokens consumed by `step`, across recorded batch/sequence changes: each
  change record carries the count at its step; the last segment runs at
  `tokens_per_step` (the config that trained it)."""
  base_step, base = 0, 0
  for r in read_changes(workdir):
    if "tokens_seen" in r and r["step"] <= step:
      base_step, base = r["step"], int(r["tokens_seen"])
  return base + (step - base_step) * tokens_per_step


def describe(changes: list[dict]) -> str:
  return "; ".join(f"{c['field']}: {c['old']!r} -> {c['new']!r}" for c in changes)


def record_changes(workdir: str, step: int, changes: list[dict], **extra: Any) -> None:
  """Appends one line per changed field: {step, field, old, new, time, ...extra}."""
  if not changes:
    return
  runlog.append(workdir, CHANGES_FILE, [json.dumps({"step": step, **c, "time": _now(), **extra})
                                        + "\n" for c in changes])


def read_changes(workdir: str) -> list[dict]:
  """The config changes recorded in a run, in order ([] if none)."""
  return runlog.read_records(workdir, CHANGES_FILE)

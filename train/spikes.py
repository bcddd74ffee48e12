"""Loss spikes: a detector over a running median of the train loss, and its policies.

In the step (`detect`, on device, so a skip needs no host round trip): step s is a spike
when its loss exceeds `train.spike_threshold` times the median of the losses of the
`train.spike_window` steps before it (all of them finite and present: none right after
the start, nor for a window after a non-finite loss). The losses live in the TrainState
(`recent_loss`, step t at slot t % LOSS_HISTORY), so a resume or a rollback restores
them with the checkpoint and detection stays exact. `train.spike_threshold=0` turns it off.

`train.on_spike` says what a spike does:
  "none"        (default) logged only;
  "skip_batch"  the step's update is not applied (as for a non-finite loss), the data
                moves on;
  "rollback"    the trainer restores the last checkpoint and skips the batches of the
                steps from it to the spike (the offending data window), then trains on.

Every spike is a line of RUN/spikes.jsonl (`SPIKES_FILE`) and a warning in the log: its
step, loss, the median, the policy and what was done, and the telemetry figure (and
layer) that moved most from the step before (`moved_most`, train/telemetry.py's keys).
A rollback's line holds `to_step` and `skip_batches` (batches skipped from that
checkpoint's data position), so a run resumed from that checkpoint skips the same
window: the data order matches the uninterrupted run's.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from train.io import runlog
from train.telemetry import MOE_KEYS, PREFIX

log = logging.getLogger(__name__)

LOSS_HISTORY = 256  # Losses kept in the TrainState: the longest train.spike_window.
SPIKES_FILE = "spikes.jsonl"
POLICIES = ("none", "skip_batch", "rollback")
# Rollbacks to one checkpoint before the trainer gives up: a spike that comes back after
# every skipped window is not in the data.
MAX_ROLLBACKS = 8


def settings(train_cfg) -> tuple[float, int, str]:
  """(threshold, window, policy); threshold 0: off. Fields absent from older runs: off."""
  return (float(train_cfg.spike_threshold), int(train_cfg.spike_window),
          str(train_cfg.on_spike))


def empty_history() -> jax.Array:
  return jnp.full((LOSS_HISTORY,), jnp.nan, jnp.float32)


def detect(train_cfg, recent_loss: jax.Array, done: jax.Array, loss: jax.Array):
  """(spike, median) of the step after `done` completed steps, on device."""
  threshold, window, _ = settings(train_cfg)
  past = recent_loss[(done - jnp.arange(window)) % LOSS_HISTORY]
  median = jnp.median(past)
  spike = jnp.all(jnp.isfinite(past)) & jnp.isfinite(loss) & (loss > threshold * median)
  return spike & (threshold > 0), median


def remember(recent_loss: jax.Array, done: jax.Array, loss: jax.Array) -> jax.Array:
  return recent_loss.at[(done + 1) % LOSS_HISTORY].set(jnp.asarray(loss, jnp.float32))


def moved_most(now: Mapping, before: Mapping | None, first_moe_layer: int) -> dict | None:
  """The per-layer telemetry figure with the largest relative change from `before` (the
  previous step's metrics) to `now`: {"key", "layer", "before", "after"}; None without
  per-layer telemetry."""
  best, best_change = None, -1.0
  for k, v in now.items():
    if not (k.startswith(PREFIX) and np.ndim(v) == 1) or before is None or k not in before:
      continue
    a, b = np.asarray(v, np.float64), np.asarray(before[k], np.float64)
    change = np.abs(a - b) / np.maximum(np.abs(b), 1e-12)
    if change.size and np.nanmax(change) > best_change:
      j = int(np.nanargmax(change))
      best_change = float(change[j])
      first = first_moe_layer if k in MOE_KEYS else 0
      best = {"key": k, "layer": first + j, "before": float(b[j]), "after": float(a[j])}
  return best


class Watch:
  """The trainer's side: each step's metrics queued (device arrays), checked in order one
  step late (`check(upto)` reads the `spike` flag of every queued step <= upto), so the
  next step is already dispatched when a flag is read."""

  def __init__(self, workdir: str, train_cfg, first_moe_layer: int, primary: bool):
    self.threshold, self.window, self.policy = settings(train_cfg)
    self.enabled = self.threshold > 0
    self.workdir = workdir
    self.first_moe_layer, self.primary = first_moe_layer, primary
    self.queue: list[tuple[int, Any]] = []
    self.before = None  # The last checked step's metrics.

  def push(self, step: int, metrics) -> None:
    if self.enabled:
      self.queue.append((step, metrics))

  def reset(self) -> None:
    """After a rollback: the queued steps were undone."""
    self.queue, self.before = [], None

  def check(self, upto: int) -> dict | None:
    """The first spike among the queued steps <= upto, as its record (not yet written:
    the trainer adds what it did, `write`); None if there is none."""
    while self.queue and self.queue[0][0] <= upto:
      step, m = self.queue.pop(0)
      before, self.before = self.before, m
      if float(m["spike"]):
        host = jax.device_get(m)
        loss, median = float(host["loss"]), float(host["spike_median"])
        return {"step": step, "loss": loss, "median": median, "ratio": loss / median,
                "threshold": self.threshold, "window": self.window, "policy": self.policy,
                "moved_most": moved_most(host, jax.device_get(before) if before else None,
                                         self.first_moe_layer)}
    return None

  def write(self, record: dict) -> None:
    moved = record.get("moved_most") or {}
    log.warning("loss spike at step %d: loss %.4f = %.2fx the median %.4f of the last %d "
                "steps (train.spike_threshold=%g); most moved: %s layer %s (%s -> %s); "
                "train.on_spike=%r: %s", record["step"], record["loss"], record["ratio"],
                record["median"], self.window, self.threshold, moved.get("key"),
                moved.get("layer"), moved.get("before"), moved.get("after"), self.policy,
                record["action"])
    if self.primary:  # An append-only log of the run (train/io/runlog.py: local or a bucket).
      runlog.append(self.workdir, SPIKES_FILE, [json.dumps(record)])


def read_spikes(workdir: str) -> list[dict]:
  return runlog.read_records(workdir, SPIKES_FILE)


def _process_zeros(answer) -> int:
  """`answer()` (an int read from the run directory) as process 0 reads it, on every
  process. The log is written by process 0 and read by all: a host whose view is stale
  (a cached listing, a segment not yet visible) must not decide otherwise, or one
  process raises while the others enter the restore's collectives and wait forever."""
  if jax.process_count() == 1:
    return int(answer())
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  mine = int(answer()) if jax.process_index() == 0 else 0
  return int(multihost_utils.broadcast_one_to_all(np.array(mine, np.int32)))


def resume_skip(workdir: str, step: int) -> int:
  """Batches to skip after restoring checkpoint `step`: the last rollback to it (0: none).
  Process 0's answer on every process (the data order must be the same everywhere)."""
  def last_skip():
    rollbacks = [r for r in read_spikes(workdir) if r.get("to_step") == step]
    return int(rollbacks[-1]["skip_batches"]) if rollbacks else 0
  return _process_zeros(last_skip)


def rollbacks_to(workdir: str, step: int) -> int:
  """Rollbacks to checkpoint `step` so far: process 0's count on every process, so the
  decision to roll back again or give up (MAX_ROLLBACKS) is the same everywhere."""
  return _process_zeros(lambda: sum(1 for r in read_spikes(workdir)
                                    if r.get("to_step") == step))

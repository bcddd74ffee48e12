"""A jax.profiler trace of a run's steps (train.profile_steps) into RUN/profile/."""

from __future__ import annotations

import logging
import shutil
import tempfile

import jax

from train.io import staging, storage

log = logging.getLogger(__name__)


class Profiler:
  """A jax.profiler trace of train.profile_steps steps into RUN/profile/, starting at
  train.profile_start (0: the first step this attempt runs; compilation happens before
  it, outside the trace). Steps carry StepTraceAnnotations ("train", step_num). On a
  bucket the trace (files jax.profiler writes) is written locally, then each of its
  files uploaded once, whole, by the process that wrote it (train/io/staging.py)."""

  def __init__(self, workdir, train_cfg, start: int):
    self.steps = int(train_cfg.profile_steps)
    self.first = max(int(train_cfg.profile_start), start + 1)
    self.last = self.first + self.steps - 1
    self.dir = storage.join(workdir, "profile")
    self.local = None  # The trace's local stand-in for a bucket's RUN/profile.
    self.active = False

  def before(self, step: int) -> None:
    if self.steps and step == self.first:
      if storage.is_url(self.dir):
        self.local = tempfile.mkdtemp(prefix="run-profile-")
      jax.profiler.start_trace(self.local or self.dir)
      self.active = True

  def after(self, step: int, metrics) -> None:
    if self.active and step == self.last:
      jax.block_until_ready(metrics)  # The trace holds the whole last step.
      self.close()
      log.info("profiled steps %d-%d into %s", self.first, self.last, self.dir)

  def close(self) -> None:
    """Ends the trace (an early exit too: preemption, error), so that it is written."""
    if not self.active:
      return
    jax.profiler.stop_trace()
    self.active = False
    if self.local:
      staging.upload_dir(self.local, self.dir)
      shutil.rmtree(self.local, ignore_errors=True)
      self.local = None

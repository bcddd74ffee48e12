"""run(config, workdir): parse the spec once, init or restore, train, evaluate, checkpoint, handle preemption.

The run directory is a lab notebook (docs/training.md, "Resuming and failures"): one
trainer holds it (RUN/LOCK, train/lifecycle/lock.py); what a run starts from, and
what it refuses, is the resume policy (train/lifecycle/resume.py); every exit path
waits for pending checkpoint saves.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import jax
import numpy as np

from model.flops import training_flops_per_token
from parallel import host_local_to_global, mesh_context
from train import checkpoint as ckpt, local_checkpoint, spikes
from train.data import poison
from train.eval.evaluator import Evaluator
from train.io import storage
from train.lifecycle import config_record, goodput, resume, session
from train.lifecycle.lock import LockError
from train.lifecycle.signals import StopSignals
from train.metrics import MetricsWriter, Progress, read_metrics
from train.peak import Peak
from train.state import PipelineOrder
from train.step import jit_train_step
from train.spec import RunSpec, parse
from train.telemetry import Profiler, per_layer_scalars

log = logging.getLogger(__name__)


class NonFiniteError(FloatingPointError):
  pass


class SpikeError(RuntimeError):
  """train.on_spike="rollback" rolled back to one checkpoint spikes.MAX_ROLLBACKS times."""


class _Preemption(StopSignals):
  """SIGTERM / SIGINT set a flag; the loop saves at the next step boundary and exits.
  A LOCK lost to another trainer (train/lifecycle/lock.py: this one missed its lease)
  stops the loop there too, without saving: the run directory is no longer its own."""

  def __init__(self, lock=None):
    super().__init__()
    self.lock = lock  # Process 0's WorkdirLock (None elsewhere).

  def requested(self, step: int, every: int, writer: MetricsWriter) -> bool:
    """Single process: every step. Several: every `every` steps (a host sync)."""
    local = np.array([self.flag.is_set(), bool(self.lock is not None and self.lock.lost)])
    if jax.process_count() > 1:
      if step % every:
        return False
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      local = np.any(multihost_utils.process_allgather(local), axis=0)
    if local[1]:
      writer.pending.clear()  # Unstored lines: the new holder trains these steps again.
      raise LockError(f"the run directory's LOCK was taken over by another trainer (this "
                      f"one missed its lease: see the log); stopped at step {step} without "
                      "saving or logging more. The new holder continues the run.")
    return bool(local[0])


@dataclasses.dataclass(frozen=True)
class RunResult:
  """What `run` did, apart from what it measured."""
  step: int  # The step the run is at when `run` returns.
  eval: dict = dataclasses.field(default_factory=dict)  # The last eval's figures ({}: none).
  preempted: bool = False  # SIGTERM / SIGINT: saved at `step`; re-running resumes.
  already_finished: bool = False  # At train.steps before the call: nothing was trained.


def _json(v):
  """A metric for metrics.jsonl: a float, or a list for a vector (e.g. MoE loads)."""
  return np.asarray(v, np.float64).tolist() if np.ndim(v) else float(v)


def run(config, workdir: str, allow_config_change: bool = False) -> RunResult:
  """Trains `config` (a ConfigDict, or the RunSpec a caller parsed) into `workdir`, resuming from its latest checkpoint; returns the
  step reached and the last eval's figures, and whether it was preempted or had
  nothing to train.

  `allow_config_change`: accept a resume whose config differs from config.json in
  fields that change what the run computes (lr, pos_encoding, batch size...);
  each change is recorded in config_changes.jsonl with its step. Operational
  fields (train.steps, logging/eval/checkpoint cadence, mesh, ...) may change
  without it and are recorded too. A different model shape is always refused.
  """
  spec = parse(config, jax.device_count())  # Once, before the directory is touched.
  new_dir = not storage.is_url(workdir) and not os.path.exists(workdir)  # Buckets: no dirs.
  try:
    return _run_locked(spec, workdir, allow_config_change)
  except BaseException:
    if new_dir and jax.process_index() == 0:
      _remove_if_empty(workdir)  # A launch that failed leaves no empty run directory.
    raise


def _remove_if_empty(workdir: str) -> None:
  """Removes `workdir` if it holds directories only (no file was written in it)."""
  if any(files for _, _, files in os.walk(workdir)):
    return
  for here, _, _ in sorted(os.walk(workdir), key=lambda w: -len(w[0])):
    try:
      os.rmdir(here)
    except OSError:
      return


def _run_locked(config: RunSpec, workdir: str, allow_config_change: bool) -> RunResult:
  ledger = goodput.Ledger(workdir, jax.process_index() == 0)  # RUN/goodput.jsonl
  with session.open_run(config, workdir, "train") as s:
    manager = ckpt.make_manager(workdir, config.train)
    try:
      ledger.lap("startup")
      opened = resume.start_or_resume(config, workdir, s, manager, allow_config_change)
      if not isinstance(opened, tuple):
        return _finished(config, workdir, s, opened)
      ledger.lap("restore" if int(opened[0].step) else "startup")
      return _train(config, workdir, s, manager, ledger, *opened)
    except LockError:
      ledger.enabled = False  # The run directory is another trainer's now.
      raise
    finally:  # Every exit (error, preemption, end) lets pending async saves finish.
      ckpt.close(manager)
      ledger.close()  # After the saves it waited for: the attempt's last record.


def _finished(config, workdir, s, state) -> RunResult:
  """A run already at train.steps: nothing to train, nothing rewritten. Only a final
  eval line that a crash cut from metrics.jsonl is computed again (same checkpoint)."""
  step, steps = int(state.step), int(config.train.steps)
  has_eval = any(r.get("split") == "eval" and r.get("step") == step
                 for r in read_metrics(workdir))
  if step != steps or has_eval:
    log.info("%s is at step %d >= train.steps=%d: nothing to train; the run is unchanged",
             workdir, step, steps)
    return RunResult(step, already_finished=True)
  log.warning("%s: the final eval line at step %d is missing from metrics.jsonl (cut by a "
              "crash?); evaluating checkpoint %d again to log it", workdir, step, step)
  with mesh_context(s.mesh, s.rules):
    figures = Evaluator(s.model_cfg, config, s.source, s.mesh, s.rules, s.shardings).run(state)
  writer = MetricsWriter(workdir, jax.process_index() == 0, tensorboard=False)
  writer.write({"step": step, "split": "eval", **figures})
  writer.close()
  return RunResult(step, figures)


def _train(config, workdir, s, manager, ledger, state, data_state, tokens_at_start
           ) -> RunResult:
  writer = MetricsWriter(workdir, jax.process_index() == 0, bool(config.train.tensorboard),
                         config.train.wandb_project)
  try:
    if rewound := writer.truncate_after(int(state.step)):
      log.warning("%d metrics lines after step %d (from an attempt that did not reach its "
                  "next checkpoint) moved to metrics.rewound.jsonl; they are logged again",
                  rewound, int(state.step))
    ledger.begin(int(state.step))
    trainer = _Trainer(config, workdir, s, manager, writer, ledger, state, data_state,
                       tokens_at_start)
    try:
      return trainer.run()
    finally:
      trainer.profiler.close()
      trainer.local.close()
  finally:
    writer.close()


class _Trainer:
  """The step loop from the state's step to train.steps: log, evaluate, checkpoint, and
  stop on preemption or (train.on_nonfinite="stop") a non-finite loss."""

  def __init__(self, config, workdir, s, manager, writer, ledger, state, data_state,
               tokens_at_start):
    self.config, self.workdir, self.s, self.manager, self.writer = (
        config, workdir, s, manager, writer)
    self.ledger = ledger  # Where the attempt's time goes (train/lifecycle/goodput.py).
    self.d, self.t = config.data, config.train
    # The circular pipeline's row order (train/state.py PipelineOrder): the trainer's state holds
    # its stacks in it; checkpoints get a copy in layer order.
    self.order = PipelineOrder.for_run(s)
    self.state = self.order.to_pipeline(state)
    self.start = int(state.step)
    self.tokens_at_start = tokens_at_start
    skip = spikes.resume_skip(workdir, self.start)
    self.iterator = self._restored_iterator(data_state, skip)
    self.rolled = (self.start, skip)  # The last rollback.
    self.watch = spikes.Watch(workdir, self.t, s.model_cfg.first_k_dense,
                              jax.process_index() == 0)
    self.step_fn = jit_train_step(s.model_cfg, self.t, s.optimizer, s.shardings,
                                  s.batch_sharding)
    self.evaluator = Evaluator(s.model_cfg, config, s.source, s.mesh, s.rules, s.shardings,
                               self.order.repeats if self.order.active else 1)
    self.peak = Peak(float(config.hardware.peak_flops), s.model_cfg.dtype,
                     jax.devices()[0].device_kind)
    self.flops_per_token = training_flops_per_token(s.model_cfg, self.d.seq_len)
    self.progress = Progress(self.t.steps, jax.process_index() == 0)
    self.pending = None  # Step N's train line, written after step N+1 is dispatched.
    self.profiler = Profiler(workdir, self.t, self.start)
    self.keep_steps = frozenset(int(k) for k in self.t.keep_steps or ())  # Branches.
    self.local = local_checkpoint.LocalTier.for_run(config, workdir,
                                                    config_record.read_record(workdir))

  def _restored_iterator(self, data_state, skip: int = 0):
    """The train iterator at a checkpoint's data position, then `skip` batches on (a
    rollback's offending window, train/spikes.py)."""
    it = poison.wrap(self.s.source.train_iterator(int(self.t.seed), self.d.batch_size,
                                                  self.d.seq_len),
                     self.d, self.s.model_cfg.vocab_size)
    if data_state:
      it.set_state(data_state)
    for _ in range(skip):
      next(it)
    return it

  def handle_spikes(self, upto: int) -> int | None:
    """Checks the steps up to `upto` for loss spikes (train/spikes.py) and acts on each as
    train.on_spike says; returns the step a rollback went back to, else None."""
    while (record := self.watch.check(upto)) is not None:
      if self.watch.policy == "rollback":
        back = self.rollback(record)
        if back is not None:
          return back
      else:
        record["action"] = ("update skipped" if self.watch.policy == "skip_batch"
                            else "logged")
        self.watch.write(record)
    return None

  def rollback(self, record: dict) -> int | None:
    """Restores the last checkpoint and skips the data from it to the spike; records it."""
    step = record["step"]
    ckpt.seal(self.manager)  # The checkpoint restored below must be final (checksums).
    back = self.manager.latest_step()
    if back is None:
      record["action"] = "logged only: no checkpoint to roll back to"
      self.watch.write(record)
      return None
    if spikes.rollbacks_to(self.workdir, back) >= spikes.MAX_ROLLBACKS:
      raise SpikeError(f"loss spike at step {step}: already rolled back to checkpoint {back} "
                       f"{spikes.MAX_ROLLBACKS} times ({spikes.SPIKES_FILE}); the spikes are "
                       "not in the skipped data. Lower train.lr, or set train.on_spike")
    skip = (self.rolled[1] if self.rolled[0] == back else 0) + step - back
    state, data_state = ckpt.restore_step(self.manager, back, self.s.template,
                                          self.s.shardings)
    self.state = self.order.to_pipeline(state)
    self.ledger.lap("restore")
    self.iterator = self._restored_iterator(data_state, skip)
    self.rolled = (back, skip)
    self.local.drop_after(back)  # Its later steps are the trajectory rolled back.
    record.update(action=f"rolled back to step {back}; the batches of steps {back + 1}-{step} "
                  "are skipped", to_step=back, skip_batches=skip)
    self.watch.write(record)  # Before the lines after `back` move: a resume finds it.
    self.watch.reset()
    self.flush()
    self.writer.sync()  # Buffered lines (a bucket run) are stored before they move.
    self.writer.truncate_after(back)
    return back

  def flush(self):
    if self.pending is not None:
      self.writer.write(self.pending)
      self.pending = None

  def check_finite(self, step: int):
    first = int(self.state.first_nonfinite_step)
    if first >= 0 and self.t.on_nonfinite == "stop":
      self.manager.wait_until_finished()  # The checkpoint named below must exist.
      good = self.manager.latest_step()
      where = (f"the last good checkpoint is step {good} in "
               f"{ckpt.checkpoint_dir(self.workdir)}" if good is not None
               else "no checkpoint was saved before it")
      raise NonFiniteError(
          f"non-finite loss or gradient at step {first}: the update was skipped and training "
          f"stopped at step {step}; {where} (set train.on_nonfinite='skip' to skip such "
          "steps instead, or lower train.lr)")

  def save(self, step: int, force: bool = False):
    self.check_finite(step)
    self.ledger.step(step)  # Waiting for the step (above) is the step's own time.
    self.writer.sync()  # The lines up to `step` are stored before its checkpoint exists.
    ckpt.save(self.manager, step, self.order.to_layers(self.state), self.iterator.get_state(),
              force=force)
    self.ledger.lap("checkpoint", flush=True)  # A resume from `step` finds it recorded.

  def save_local(self, step: int):
    """The local tier's save (train/local_checkpoint.py), with the same lines stored."""
    self.check_finite(step)
    self.ledger.step(step)
    self.writer.sync()
    self.local.save(step, self.order.to_layers(self.state), self.iterator.get_state())
    self.ledger.lap("checkpoint", flush=True)

  def log_line(self, step: int, metrics, seconds_per_step: float, compile_s):
    """`metrics`: host values (fetched before `seconds_per_step` was measured)."""
    d = self.d
    tokens_per_s = d.batch_size * d.seq_len / seconds_per_step
    # model/flops.py's mfu, against a peak that a faster run raises (train/peak.py).
    mfu = self.peak.utilization(tokens_per_s * self.flops_per_token / jax.device_count())
    tokens_seen = self.tokens_at_start + (step - self.start) * d.batch_size * d.seq_len
    metrics = per_layer_scalars(metrics, self.s.model_cfg.first_k_dense)  # telemetry/*/L<i>
    self.pending = {"step": step, "split": "train", **{k: _json(v) for k, v in metrics.items()},
                    "tokens_seen": tokens_seen,
                    "train_flops": tokens_seen * self.flops_per_token,  # model/flops.py
                    "step_time": seconds_per_step,
                    "tokens_per_s": tokens_per_s, "mfu": mfu}
    if hasattr(self.iterator, "tokens_seen"):  # A mixture: tokens_seen/<domain>.
      self.pending.update(self.iterator.tokens_seen())
    if compile_s is not None:
      self.pending["compile_time"] = compile_s
    self.progress.update(step, float(metrics["loss"]), tokens_per_s, mfu)
    self.check_finite(step)

  def eval_at_start(self) -> None:
    """eval.at_start: the untrained model's eval line at step 0 (once: a restart from
    scratch finds it in metrics.jsonl)."""
    if self.start or not self.config.eval.at_start:
      return
    if not any(r.get("split") == "eval" and r.get("step") == 0
               for r in read_metrics(self.workdir, warn=False)):
      self.writer.write({"step": 0, "split": "eval", **self.evaluator.run(self.state)})

  def run(self) -> RunResult:
    t, s = self.t, self.s
    last_eval = {}
    with mesh_context(s.mesh, s.rules), _Preemption(s.lock) as preempt:
      self.ledger.lap("startup")
      self.eval_at_start()
      self.ledger.lap("eval")
      t0, s0, compile_s = time.time(), self.start, None
      step = self.start + 1
      while step <= t.steps:
        batch = host_local_to_global(next(self.iterator), s.mesh, s.batch_sharding)
        self.ledger.lap("data")
        if step == self.start + 1 and compile_s is None:
          tc = time.time()
          self.step_fn = self.step_fn.lower(self.state, batch).compile()
          compile_s = time.time() - tc
          t0 = time.time()
          self.ledger.lap("compile")
        self.profiler.before(step)
        with jax.profiler.StepTraceAnnotation("train", step_num=step):
          self.state, metrics = self.step_fn(self.state, batch)
        self.profiler.after(step, metrics)
        self.watch.push(step, metrics)
        saving = step % t.checkpoint_every == 0 or step == t.steps or step in self.keep_steps
        local = not saving and self.local.due(step)
        # The step before (dispatched: the device is busy); a checkpoint's own step first.
        if (back := self.handle_spikes(step if saving or local else step - 1)) is not None:
          step, t0, s0 = back + 1, time.time(), back
          continue
        self.flush()
        if step % t.log_every == 0 or step == t.steps:
          metrics = jax.device_get(metrics)  # Waits for the step: time after it.
          self.log_line(step, metrics, (time.time() - t0) / (step - s0),
                        compile_s if s0 == self.start else None)
          t0, s0 = time.time(), step
        self.ledger.step(step)
        if step % t.eval_every == 0 or step == t.steps:
          self.flush()
          last_eval = self.evaluator.run(self.state)
          self.writer.write({"step": step, "split": "eval", **last_eval})
          t0 = time.time()
          self.ledger.lap("eval")
        if saving:
          self.flush()  # A kill right after the save must not lose this line.
          self.save(step, force=step == t.steps or step in self.keep_steps)
        elif local:
          self.flush()
          self.save_local(step)
        if step < t.steps and preempt.requested(step, t.log_every, self.writer):
          if (back := self.handle_spikes(step)) is not None:  # Never save a spike's update.
            step, t0, s0 = back + 1, time.time(), back
            continue
          self.flush()
          if self.manager.latest_step() != step:
            self.save(step, force=True)
          log.warning("preempted: saving step %d; re-run the same command to resume", step)
          return RunResult(step, last_eval, preempted=True)
        step += 1
      self.flush()
    return RunResult(int(t.steps), last_eval)


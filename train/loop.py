"""run(config, workdir): init or restore, train, evaluate, checkpoint, handle preemption."""

from __future__ import annotations

import functools
import logging
import signal
import threading
import time

import flax.linen as nn
import jax
import numpy as np

from model.flops import training_flops_per_token
from parallel import (batch_sharding, host_batch_slice, host_local_to_global,
                      logical_rules, logical_to_mesh_sharding, make_mesh, mesh_context)
from train import checkpoint as ckpt
from train import run_config
from train.data import make_source
from train.evaluation import Evaluator
from train.metrics import MetricsWriter, Progress, measure_peak_flops
from train.optim import make_optimizer
from train.state import init_state
from train.step import make_train_step

log = logging.getLogger(__name__)


class NonFiniteError(FloatingPointError):
  pass


class _Preemption:
  """SIGTERM / SIGINT set a flag; the loop saves at the next step boundary and exits."""

  def __init__(self):
    self.flag = threading.Event()
    self.previous = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self.previous[sig] = signal.signal(sig, lambda *_: self.flag.set())
    return self

  def __exit__(self, *exc):
    for sig, handler in self.previous.items():
      signal.signal(sig, handler)

  def requested(self, step: int, every: int) -> bool:
    """Single process: every step. Several: every `every` steps (a host sync)."""
    local = self.flag.is_set()
    if jax.process_count() == 1:
      return local
    if step % every:
      return False
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    return bool(np.any(multihost_utils.process_allgather(np.array(local))))


def _json(v):
  """A metric for metrics.jsonl: a float, or a list for a vector (e.g. MoE loads)."""
  return np.asarray(v, np.float64).tolist() if np.ndim(v) else float(v)


def run(config, workdir: str) -> dict:
  """Trains `config` into `workdir` (resuming if it holds checkpoints); returns the last eval."""
  primary = jax.process_index() == 0
  model_cfg = run_config.validate(config, jax.device_count())
  d, t = config.data, config.train
  mesh = make_mesh(config.mesh)
  rules = logical_rules(mesh=mesh, num_kv_heads=model_cfg.num_kv_heads,
                        num_heads=model_cfg.num_heads)
  b_sharding = batch_sharding(mesh, rules)
  # The pipeline reads the rows this process's devices hold: processes that differ
  # only along non-batch axes (tensor across hosts) read the same rows.
  rows = host_batch_slice(b_sharding, d.batch_size)
  rows_per_shard = rows.stop - rows.start
  source = make_source(d, workdir, rows.start // rows_per_shard,
                       d.batch_size // rows_per_shard)
  if source.tokenizer.vocab_size > model_cfg.vocab_size:
    raise ValueError(f"config.model.vocab_size={model_cfg.vocab_size} is smaller than the "
                     f"tokenizer's vocabulary ({source.tokenizer.vocab_size})")

  optimizer = make_optimizer(t)
  init_fn = functools.partial(init_state, model_cfg, optimizer, int(t.seed), int(d.seq_len))
  abstract = jax.eval_shape(init_fn)
  shardings = logical_to_mesh_sharding(abstract, mesh, rules)
  template = nn.unbox(abstract)

  manager = ckpt.make_manager(workdir, t)
  if manager.all_steps():
    run_config.check_compatible(run_config.read_config(workdir), model_cfg)
  with mesh_context(mesh, rules):
    state, data_state = ckpt.restore_latest(manager, workdir, template, shardings)
    if state is None:
      state = jax.jit(lambda: nn.unbox(init_fn()), out_shardings=shardings)()
  start = int(state.step)
  run_config.write_config(workdir, config)
  writer = MetricsWriter(workdir, primary, bool(t.tensorboard))
  writer.truncate_after(start)

  iterator = source.train_iterator(int(t.seed), d.batch_size, d.seq_len)
  if data_state:
    iterator.set_state(data_state)

  step_fn = jax.jit(make_train_step(model_cfg, t, optimizer), donate_argnums=0,
                    in_shardings=(shardings, b_sharding), out_shardings=(shardings, None))
  evaluator = Evaluator(model_cfg, config, source, mesh, rules, shardings)
  peak = float(config.hardware.peak_flops) * jax.device_count() or measure_peak_flops(
      model_cfg.dtype)
  flops_per_token = training_flops_per_token(model_cfg, d.seq_len)
  progress = Progress(t.steps, primary)
  if primary:
    log.info("training %s from step %d to %d into %s", config.get("name", "run"), start,
             t.steps, workdir)

  def next_batch():
    return host_local_to_global(next(iterator), mesh, b_sharding)

  def check_finite(step: int):
    first = int(state.first_nonfinite_step)
    if first >= 0 and t.on_nonfinite == "stop":
      good = manager.latest_step()
      raise NonFiniteError(
          f"non-finite loss or gradient at step {first}: the update was skipped and "
          f"training stopped at step {step}; the last good checkpoint is step {good} in "
          f"{ckpt.checkpoint_dir(workdir)} (set train.on_nonfinite='skip' to skip such "
          "steps instead)")

  def save(step: int, force: bool = False):
    check_finite(step)
    ckpt.save(manager, step, state, iterator.get_state(), force=force)

  last_eval = {}
  with mesh_context(mesh, rules), _Preemption() as preempt:
    t0, s0 = time.time(), start
    pending = None
    compile_s = None
    for step in range(start + 1, t.steps + 1):
      batch = next_batch()
      if compile_s is None:
        tc = time.time()
        step_fn = step_fn.lower(state, batch).compile()
        compile_s = time.time() - tc
        t0 = time.time()
      state, metrics = step_fn(state, batch)
      if pending is not None:  # Read step N's metrics after step N+1 is dispatched.
        writer.write(pending)
        pending = None
      if step % t.log_every == 0 or step == t.steps:
        metrics = jax.device_get(metrics)
        dt = (time.time() - t0) / (step - s0)
        tokens_per_s = d.batch_size * d.seq_len / dt
        mfu = tokens_per_s * flops_per_token / peak
        pending = {"step": step, "split": "train", **{k: _json(v) for k, v in metrics.items()},
                   "tokens_seen": step * d.batch_size * d.seq_len, "step_time": dt,
                   "tokens_per_s": tokens_per_s, "mfu": mfu}
        if compile_s is not None and s0 == start:
          pending["compile_time"] = compile_s
        progress.update(step, float(metrics["loss"]), tokens_per_s, mfu)
        check_finite(step)
        t0, s0 = time.time(), step
      if step % t.eval_every == 0 or step == t.steps:
        if pending is not None:
          writer.write(pending)
          pending = None
        last_eval = evaluator.run(state)
        writer.write({"step": step, "split": "eval", **last_eval})
        t0 = time.time()
      if step % t.checkpoint_every == 0 or step == t.steps:
        if pending is not None:  # A kill right after the save must not lose this line.
          writer.write(pending)
          pending = None
        save(step, force=step == t.steps)
      if step < t.steps and preempt.requested(step, t.log_every):
        if pending is not None:
          writer.write(pending)
        if manager.latest_step() != step:
          save(step, force=True)
        manager.wait_until_finished()
        log.warning("preempted: saved step %d; re-run the same command to resume", step)
        writer.close()
        return {"preempted_at": step, **last_eval}
    if pending is not None:
      writer.write(pending)
  manager.wait_until_finished()
  manager.close()
  writer.close()
  if start >= t.steps and not last_eval:
    last_eval = {"already_finished": True}
  return last_eval

"""The training loop's promises: learning, exact resume, preemption, failure paths."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from experiments.configs import tiny
from tests.cli import fail_if_crashed
from train import load_run
from train import loop
from train.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DETERMINISTIC = ("loss", "ce_loss", "grad_norm", "param_norm", "lr", "tokens")


def smoke(**overrides):
  c = tiny.get_config("smoke")
  c.train.async_checkpoint = False
  c.train.tensorboard = False
  for key, value in overrides.items():
    node = c
    *path, last = key.split(".")
    for p in path:
      node = node[p]
    node[last] = value
  return c


def train_lines(workdir):
  return [r for r in read_metrics(workdir) if r["split"] == "train"]


def params_of(workdir, step=None):
  import jax
  return jax.tree.map(np.asarray, load_run(workdir, step=step).variables["params"])


def launch_cmd(workdir, *flags):
  return [sys.executable, os.path.join(ROOT, "launch.py"),
          "--config", os.path.join(ROOT, "experiments/configs/tiny.py:smoke"),
          "--workdir", str(workdir), "--config.train.async_checkpoint=False",
          "--config.train.tensorboard=False", *flags]


def wait_for_step(workdir, step, proc, timeout=240):
  deadline = time.time() + timeout
  while time.time() < deadline:
    lines = train_lines(workdir)
    if lines and lines[-1]["step"] >= step:
      return
    if proc.poll() is not None:
      fail_if_crashed(proc.args, proc.returncode, "(output not captured)")
      raise AssertionError(f"training exited early with {proc.returncode}")
    time.sleep(0.2)
  raise AssertionError(f"step {step} not logged within {timeout}s")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """One uninterrupted 12-step run, shared by the resume tests."""
  workdir = tmp_path_factory.mktemp("reference")
  result = loop.run(smoke(**{"train.steps": 12, "train.log_every": 1,
                             "train.checkpoint_every": 4}), str(workdir))
  return workdir, result


def test_short_run_learns_and_logs_the_contract(reference):
  workdir, result = reference
  lines = train_lines(workdir)
  assert [r["step"] for r in lines] == list(range(1, 13))
  assert np.mean([r["loss"] for r in lines[-3:]]) < np.mean([r["loss"] for r in lines[:3]])
  evals = [r for r in read_metrics(workdir) if r["split"] == "eval"]
  assert evals and {"loss", "bpb", "ppl", "accuracy"} <= set(evals[-1])
  assert result.eval["loss"] == evals[-1]["loss"]
  assert (result.step, result.preempted, result.already_finished) == (12, False, False)
  for key in ("tokens_per_s", "mfu", "grad_norm", "param_norm", "lr", "tokens_seen"):
    assert key in lines[-1]
  # Timed after the step finished (not when it was queued): MFU can't pass 100%.
  assert all(0 < r["mfu"] < 1 for r in lines), [r["mfu"] for r in lines]
  config = json.load(open(os.path.join(workdir, "config.json")))
  assert config["_run"]["jax_version"] and "device_kind" in config["_run"]
  run = load_run(str(workdir))
  assert run.step == 12 and run.tokenizer.decode(run.tokenizer.encode("ROMEO:")) == "ROMEO:"
  assert run.model_config.num_layers == 2 and run.metrics == read_metrics(workdir)


def test_sigkill_then_resume_is_bitwise_identical(reference, tmp_path):
  ref_dir, _ = reference
  proc = subprocess.Popen(launch_cmd(tmp_path, "--config.train.steps=12",
                                     "--config.train.log_every=1",
                                     "--config.train.checkpoint_every=4"),
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    wait_for_step(tmp_path, 6, proc)  # Past the step-4 checkpoint, before step 8's.
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  loop.run(smoke(**{"train.steps": 12, "train.log_every": 1, "train.checkpoint_every": 4}),
           str(tmp_path))
  got, want = train_lines(tmp_path), train_lines(ref_dir)
  assert [r["step"] for r in got] == list(range(1, 13))  # One line per step, none twice.
  for g, w in zip(got, want):
    assert {k: g[k] for k in DETERMINISTIC} == {k: w[k] for k in DETERMINISTIC}
  for a, b in zip(*(map(lambda d: __import__("jax").tree.leaves(params_of(d)),
                        (tmp_path, ref_dir)))):
    np.testing.assert_array_equal(a, b)


def test_killed_before_its_first_checkpoint_restarts_bitwise_identical(reference, tmp_path):
  """A preemption before any save committed: the same command redoes the run from step
  0, the killed attempt's lines kept in metrics.rewound.jsonl, and ends bitwise equal to
  an uninterrupted run."""
  ref_dir, _ = reference
  cmd = launch_cmd(tmp_path, "--config.train.steps=12", "--config.train.log_every=1",
                   "--config.train.checkpoint_every=100")  # Only step 12 is saved.
  proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    wait_for_step(tmp_path, 5, proc)
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  killed = [r["step"] for r in train_lines(tmp_path)]
  assert not os.listdir(os.path.join(tmp_path, "checkpoints")) and killed[-1] < 12
  done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
  fail_if_crashed(cmd, done.returncode, done.stdout + done.stderr)
  assert done.returncode == 0, done.stderr[-2000:]
  assert "killed before its first checkpoint committed; restarting from step 0" in done.stderr
  got, want = train_lines(tmp_path), train_lines(ref_dir)
  assert [r["step"] for r in got] == list(range(1, 13))  # One line per step, none twice.
  for g, w in zip(got, want):
    assert {k: g[k] for k in DETERMINISTIC} == {k: w[k] for k in DETERMINISTIC}
  with open(os.path.join(tmp_path, "metrics.rewound.jsonl")) as f:
    rewound = [json.loads(line) for line in f]
  assert [r["step"] for r in rewound if r["split"] == "train"] == killed
  assert {r["rewound_to"] for r in rewound} == {0}
  for a, b in zip(*(map(lambda d: __import__("jax").tree.leaves(params_of(d)),
                        (tmp_path, ref_dir)))):
    np.testing.assert_array_equal(a, b)


def test_sigterm_saves_and_exits_zero_then_rerun_finishes(tmp_path):
  flags = ["--config.train.steps=400", "--config.train.log_every=1",
           "--config.train.checkpoint_every=1000", "--config.train.eval_every=1000"]
  proc = subprocess.Popen(launch_cmd(tmp_path, *flags), stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True)
  wait_for_step(tmp_path, 2, proc)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=120)
  fail_if_crashed(proc.args, proc.returncode, out)
  assert proc.returncode == 0 and "preempted at step" in out
  saved = int(out.split("preempted at step ")[1].split(";")[0])
  assert os.path.isdir(os.path.join(tmp_path, "checkpoints", str(saved)))
  assert load_run(str(tmp_path)).step == saved


def test_corrupt_latest_checkpoint_falls_back_and_is_kept(reference, tmp_path, caplog):
  import shutil
  ref_dir, _ = reference
  shutil.copytree(ref_dir, tmp_path, dirs_exist_ok=True)
  latest = os.path.join(tmp_path, "checkpoints", "12", "state")
  for root, _, files in os.walk(latest):
    for f in files:
      if not f.startswith("_"):
        with open(os.path.join(root, f), "wb") as fh:
          fh.write(b"garbage")
  run = load_run(str(tmp_path))
  assert "step 12 failed to restore" in caplog.text
  assert run.step == 8  # The previous good checkpoint; a reader moves nothing.
  assert not os.path.exists(os.path.join(tmp_path, "checkpoints_corrupt"))
  loop.run(smoke(**{"train.steps": 12, "train.log_every": 1, "train.checkpoint_every": 4}),
           str(tmp_path))  # The trainer resumes from 8 and keeps the corrupt one aside.
  assert os.path.isdir(os.path.join(tmp_path, "checkpoints_corrupt", "12"))
  assert load_run(str(tmp_path)).step == 12
  rewound = [json.loads(line) for line in open(os.path.join(tmp_path, "metrics.rewound.jsonl"))]
  assert {r["step"] for r in rewound} == set(range(9, 13))  # Kept, not deleted.
  assert [r["step"] for r in train_lines(tmp_path)] == list(range(1, 13))


@pytest.mark.parametrize("mode", ["stop", "skip"])
def test_nonfinite_loss(mode, tmp_path):
  c = smoke(**{"train.steps": 4, "train.log_every": 1, "train.checkpoint_every": 1,
               "train.lr": 1e30, "train.warmup_steps": 0, "train.grad_clip": 0.0,
               "train.on_nonfinite": mode})
  if mode == "stop":
    with pytest.raises(loop.NonFiniteError, match=r"non-finite loss or gradient at step \d"):
      loop.run(c, str(tmp_path))
    good = load_run(str(tmp_path))  # The last good checkpoint survives and loads.
    assert all(np.isfinite(np.asarray(x)).all()
               for x in __import__("jax").tree.leaves(good.variables["params"]))
  else:
    loop.run(c, str(tmp_path))
    assert train_lines(tmp_path)[-1]["skipped_steps"] >= 1


def test_resume_with_a_different_model_shape_is_refused(reference, tmp_path):
  import shutil
  shutil.copytree(reference[0], tmp_path, dirs_exist_ok=True)
  with pytest.raises(ValueError, match="d_model: checkpoint 32 vs config 48"):
    loop.run(smoke(**{"model.d_model": 48, "train.steps": 14}), str(tmp_path))


@pytest.mark.parametrize("overrides,match", [
    ({"model.num_kv_heads": 3}, "num_kv_heads"),
    ({"data.batch_size": 12}, "data.batch_size"),
    ({"model.pos_encoding": "learned", "data.seq_len": 128}, "data.seq_len"),
    ({"train.schedule": "step"}, "train.schedule"),
])
def test_config_errors_before_compiling(overrides, match, tmp_path):
  with pytest.raises(ValueError, match=match):
    loop.run(smoke(**overrides), str(tmp_path))
  assert not os.path.exists(os.path.join(tmp_path, "checkpoints"))

"""MoE through the training system: the loss-free bias is model state updated once per
step toward balance (never a parameter, never in the optimizer state), the MoE metrics
reach metrics.jsonl, and an E=8, R=2 run launched like `make train` resumes exactly
after SIGKILL."""

import os
import signal
import subprocess
import time

import flax.linen as nn
import jax
import numpy as np
import pytest

from tests.train.test_loop import DETERMINISTIC, launch_cmd, smoke, train_lines
from train import load_run
from train import loop
from train.optim import make_optimizer
from train.state import init_state


MOE = {"model.num_experts": 8, "model.experts_per_token": 2, "model.expert_mlp_dim": 32,
       "model.load_balance": "loss_free", "model.bias_update_rate": 0.01}
RUN = {"train.steps": 16, "train.log_every": 1, "train.checkpoint_every": 4,
       "train.eval_every": 8}


def paths(tree) -> list[str]:
  return [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """One uninterrupted E=8, R=2 loss-free run (16 steps, checkpoints every 4)."""
  workdir = tmp_path_factory.mktemp("moe_reference")
  loop.run(smoke(**MOE, **RUN), str(workdir))
  return workdir


def test_bias_moves_toward_balance_every_step_and_is_not_optimized(reference):
  """Through the loop's make_train_step / init_state: after every step the bias moved by
  exactly u * sign(mean load - load) of that step's logged loads: toward balance, once
  per step, untouched by Adam, weight decay or the learning rate."""
  run = load_run(str(reference))
  optimizer = make_optimizer(run.config.train)
  abstract = jax.eval_shape(lambda: nn.unbox(init_state(run.model_config, optimizer, 0, 32)))
  assert paths(abstract.model_state) == ["['moe_state']['layers']['ffn']['router']['bias']"]
  for tree in (abstract.params, abstract.opt_state):
    assert not any("moe_state" in p or "bias" in p for p in paths(tree))
  # The optimizer state is a function of the parameters alone.
  assert (jax.tree.structure(abstract.opt_state) ==
          jax.tree.structure(jax.eval_shape(optimizer.init, abstract.params)))

  lines = train_lines(reference)
  bias = np.zeros((2, 8), np.float32)
  by_step = {}
  for r in lines:
    loads = np.array([r["moe_load/layer0"], r["moe_load/layer1"]])
    assert loads.sum() == 2 * 8 * 32 * 2 and r["moe_maxvio"] > 0  # layers x tokens x R
    step = np.sign(loads.mean(-1, keepdims=True) - loads).astype(np.float32)
    assert (step != 0).any()  # unbalanced, so the bias changes at this step
    bias = bias + np.float32(0.01) * step
    by_step[r["step"]] = bias
    # The logged bias (TensorBoard's histograms) is the one this step left behind.
    np.testing.assert_allclose([r["moe_bias/layer0"], r["moe_bias/layer1"]], bias, atol=1e-6)
    assert r["moe_bias_norm"] == pytest.approx(np.linalg.norm(bias), rel=1e-5)
    assert r["moe_bias_max"] == pytest.approx(np.abs(bias).max(), rel=1e-5)
  kept = [int(s) for s in os.listdir(os.path.join(reference, "checkpoints")) if s.isdigit()]
  assert len(kept) >= 2
  for s in kept:
    got = load_run(str(reference), step=s).variables["moe_state"]["layers"]["ffn"]["router"]
    np.testing.assert_array_equal(got["bias"], by_step[s], err_msg=f"step {s}")
    logged = next(r for r in lines if r["step"] == s)
    assert logged["moe_bias_norm"] == pytest.approx(np.linalg.norm(got["bias"]), rel=1e-5)


def test_moe_run_launched_like_make_train_resumes_exactly_after_sigkill(reference, tmp_path):
  """E=8, R=2 loss-free: launch.py in a subprocess, SIGKILL after the first checkpoint,
  resume; params, router biases and every logged figure equal an uninterrupted run."""
  ref_dir, work = reference, tmp_path
  flags = [f"--config.{k}={v}" for k, v in {**MOE, **RUN}.items()]
  proc = subprocess.Popen(launch_cmd(work, *flags), stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  first, deadline = os.path.join(work, "checkpoints", "4"), time.time() + 240
  try:  # Poll often: after the first checkpoint the rest of the run takes about a second.
    while not os.path.isdir(first) and proc.poll() is None and time.time() < deadline:
      time.sleep(0.005)
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
  killed_at = max(int(s) for s in os.listdir(os.path.join(work, "checkpoints")) if s.isdigit())
  assert killed_at < RUN["train.steps"]
  loop.run(smoke(**MOE, **RUN), str(work))

  got, want = train_lines(work), train_lines(ref_dir)
  assert [r["step"] for r in got] == list(range(1, 17))  # one line per step, none twice
  moe_keys = sorted(k for k in want[0] if k.startswith("moe_"))
  assert {"moe_maxvio", "moe_load", "moe_load/layer1", "moe_router_entropy/layer0",
          "moe_dropped_frac", "moe_lb_loss/layer1"} <= set(moe_keys)
  assert len(want[0]["moe_load/layer0"]) == 8 and sum(want[0]["moe_load/layer0"]) == 8 * 32 * 2
  for g, w in zip(got, want):
    assert {k: g[k] for k in DETERMINISTIC + tuple(moe_keys)} == {
        k: w[k] for k in DETERMINISTIC + tuple(moe_keys)}, g["step"]
  evals = lambda d: [r for r in load_run(str(d)).metrics if r["split"] == "eval"]
  assert [r["moe_maxvio_global"] for r in evals(work)] == [
      r["moe_maxvio_global"] for r in evals(ref_dir)]
  a, b = load_run(str(work)).variables, load_run(str(ref_dir)).variables
  assert set(a) == {"params", "moe_state"}
  assert paths(a) == paths(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  bias = np.asarray(a["moe_state"]["layers"]["ffn"]["router"]["bias"])
  assert np.abs(bias).max() > 0  # the bias did move during training

"""train.z_loss (PaLM's output z-loss) and the output-logit telemetry of the train step:
the step's gradient of the z term equals a direct computation over the full logits (with
and without micro-batches), and launch.py records the coefficient and logs the term."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments.configs.base import train_defaults
from model import ModelConfig, Transformer
from tests.cli import launch
from train import load_run
from train.state import make_state
from train.step import make_train_step

B, L, Z = 4, 8, 0.5


def _setup():
  cfg = ModelConfig(vocab_size=61, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2,
                    mlp_dim=64, max_seq_len=L, loss_chunks=2)
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  batch = {"inputs": jax.random.randint(k1, (B, L), 0, cfg.vocab_size),
           "targets": jax.random.randint(k2, (B, L), 0, cfg.vocab_size),
           "positions": jnp.tile(jnp.arange(L), (B, 1)),
           "segment_ids": jnp.ones((B, L), jnp.int32),
           "weights": (jax.random.uniform(k3, (B, L)) > 0.2).astype(jnp.float32)}
  params = Transformer(cfg).init(jax.random.key(1), batch["inputs"])["params"]
  params = jax.tree.map(lambda p: p * 3.0, params)  # Larger log Z than at init.
  return cfg, params, batch


def _step(cfg, params, batch, z, accum):
  t = train_defaults()
  t.z_loss, t.grad_accum, t.steps = z, accum, 10
  # SGD with lr 1: the parameter change is minus the gradient.
  step = jax.jit(make_train_step(cfg, t, optax.sgd(1.0)))
  new, metrics = step(make_state(params, {}, optax.sgd(1.0), 0), batch)
  return jax.tree.map(lambda new_p, p: new_p - p, new.params, params), metrics


@pytest.mark.parametrize("accum", [1, 2])
def test_z_loss_gradient_and_logit_telemetry_match_the_full_logits(accum):
  cfg, params, batch = _setup()
  w_BL = batch["weights"]

  def direct(p, z):  # The full [B, L, V] logits, no tiling: CE + z * mean(log² Z).
    logits_BLV = Transformer(cfg).apply({"params": p}, batch["inputs"], batch["positions"],
                                        batch["segment_ids"], deterministic=True)
    logits_BLV = logits_BLV.astype(jnp.float32)
    logz_BL = jax.nn.logsumexp(logits_BLV, axis=-1)
    ce_BL = logz_BL - jnp.take_along_axis(logits_BLV, batch["targets"][..., None], -1)[..., 0]
    return jnp.sum((ce_BL + z * jnp.square(logz_BL)) * w_BL) / jnp.sum(w_BL), logits_BLV

  (loss_want, logits_BLV), g_want = jax.value_and_grad(direct, has_aux=True)(params, Z)
  g_z = jax.grad(lambda p: direct(p, Z)[0] - direct(p, 0.0)[0])(params)
  delta, m = _step(cfg, params, batch, Z, accum)  # SGD, lr 1: delta = -gradient.
  np.testing.assert_allclose(m["loss"], loss_want, rtol=1e-5)
  np.testing.assert_allclose(m["loss"] - m["ce_loss"], m["z_loss"], rtol=1e-5)
  for (path, d), w in zip(jax.tree_util.tree_leaves_with_path(delta), jax.tree.leaves(g_want)):
    np.testing.assert_allclose(-d, w, rtol=2e-3, atol=1e-6, err_msg=str(path))
  # The z term moves the gradient far more than the tolerance: a step without it fails.
  norm = lambda t: float(optax.tree.norm(t))
  assert norm(g_z) > 0.1 * norm(g_want)
  keep = np.asarray(w_BL) > 0
  logits = np.asarray(logits_BLV, np.float32)
  np.testing.assert_allclose(m["telemetry/logit_max"], logits.max(-1)[keep].max(),
                             rtol=1e-5)
  np.testing.assert_allclose(m["telemetry/logit_mean"], logits.mean(-1)[keep].mean(),
                             rtol=1e-4, atol=1e-6)


def test_launch_records_z_loss_and_logs_it_apart_from_ce(tmp_path):
  launch("--workdir", str(tmp_path), "--config.train.async_checkpoint=False",
         "--config.train.tensorboard=False", "--config.train.log_every=1",
         "--config.train.steps=2", "--config.train.z_loss=1e-3")
  run = load_run(str(tmp_path))
  assert json.load(open(tmp_path / "config.json"))["train"]["z_loss"] == 1e-3
  rows = [r for r in run.metrics if r.get("split") == "train" and "z_loss" in r]
  assert len(rows) == 2
  for r in rows:
    assert r["z_loss"] > 0 and "telemetry/logit_max" in r
    np.testing.assert_allclose(r["loss"], r["ce_loss"] + r["z_loss"], rtol=1e-5)
  with pytest.raises(BaseException, match="train.z_loss"):
    launch("--workdir", str(tmp_path / "bad"), "--config.train.z_loss=-1")

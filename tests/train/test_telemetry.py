"""train.telemetry (train/telemetry.py): the step's per-layer figures equal direct
computations outside the step (the max attention logit of layer 0 from its q and k, the
RMS of the parameters and of the gradient of a plain cross-entropy), for the reference
and blockwise attention, with and without micro-batches; MLA reports too; launch.py logs
them per layer and records the switch."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments.configs.base import train_defaults
from model import ModelConfig, Transformer, mup, positional
from model.attention.reference import make_mask
from model.layers import make_norm
from model.transformer import unstack_layers
from tests.cli import launch
from train import load_run
from train.lifecycle import session
from train.state import make_state
from train.step import make_train_step

B, L = 4, 16
CFG = ModelConfig(vocab_size=61, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  mlp_dim=64, max_seq_len=L)


def _batch(cfg):
  k1, k2 = jax.random.split(jax.random.key(0))
  seg_BL = jnp.concatenate([jnp.ones((B, 10), jnp.int32), 2 * jnp.ones((B, 6), jnp.int32)], 1)
  return {"inputs": jax.random.randint(k1, (B, L), 0, cfg.vocab_size),
          "targets": jax.random.randint(k2, (B, L), 0, cfg.vocab_size),
          "positions": jnp.concatenate([jnp.arange(10), jnp.arange(6)])[None].repeat(B, 0),
          "segment_ids": seg_BL, "weights": jnp.ones((B, L), jnp.float32)}


def direct_max_logit(cfg, params, batch) -> float:
  """Layer 0's largest attention logit, by hand: its input is the embedding."""
  _, inter = Transformer(cfg).apply({"params": params}, batch["inputs"], batch["positions"],
                                    batch["segment_ids"], mutable=["intermediates"])
  x_BLD = inter["intermediates"]["embedded_BLD"][0]
  p = unstack_layers(cfg, params)["layer_0"]
  h_BLD = make_norm(cfg).apply({"params": p["norm1"]}, x_BLD)
  q_BLNH = jnp.einsum("BLD,DNH->BLNH", h_BLD, p["attn"]["q"]["w"])
  k_BLKH = jnp.einsum("BLD,DKH->BLKH", h_BLD, p["attn"]["k"]["w"])
  pos_BL, n = batch["positions"], x_BLD.shape[1]
  q_BLNH = positional.apply_rope(q_BLNH, pos_BL, cfg, n)
  k_BLNH = jnp.repeat(positional.apply_rope(k_BLKH, pos_BL, cfg, n), cfg.num_groups, axis=2)
  s_BNLS = jnp.einsum("BLNH,BSNH->BNLS", q_BLNH, k_BLNH) * mup.softmax_scale(cfg)
  seg_BL = batch["segment_ids"]
  mask_BLS = make_mask(jnp.arange(n), jnp.arange(n), seg_BL, seg_BL)
  return float(jnp.max(jnp.where(mask_BLS[:, None], s_BNLS, -jnp.inf)))


def _rms(tree) -> float:
  leaves = [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)]
  return float(np.sqrt(np.mean(np.square(np.concatenate(leaves)))))


def _step(cfg, params, batch, accum=1, telemetry=True):
  t = train_defaults()
  t.grad_accum, t.steps, t.telemetry, t.grad_clip = accum, 10, telemetry, 0.0
  step = jax.jit(make_train_step(cfg, t, optax.sgd(1.0)))  # SGD, lr 1: update = -grad.
  return step(make_state(params, {}, optax.sgd(1.0), 0), jax.tree.map(jnp.asarray, batch))[1]


@pytest.mark.parametrize("impl,accum", [("xla", 1), ("blockwise", 2)])
def test_step_telemetry_equals_direct_computation(impl, accum):
  cfg = CFG.replace(attention_impl=impl, attention_block_q=8, attention_block_kv=8)
  batch = _batch(cfg)
  params = nn.unbox(Transformer(cfg).init(jax.random.key(1), batch["inputs"])["params"])
  params = jax.tree.map(lambda x: 3.0 * x, params)  # Logits well away from 0.
  m = _step(cfg, params, batch, accum)

  np.testing.assert_allclose(m["telemetry/attn_logit_max"][0],
                             direct_max_logit(cfg, params, batch), rtol=1e-5)
  layer0 = unstack_layers(cfg, params)["layer_0"]
  np.testing.assert_allclose(m["telemetry/param_rms/attn"][0], _rms(layer0["attn"]), rtol=1e-5)
  np.testing.assert_allclose(m["telemetry/param_rms/embed"], _rms(params["embedder"]),
                             rtol=1e-5)

  def ce(p):  # Plain cross-entropy over the full logits: no tiling, no telemetry.
    logits_BLV = Transformer(cfg).apply({"params": p}, batch["inputs"], batch["positions"],
                                        batch["segment_ids"])
    return optax.softmax_cross_entropy_with_integer_labels(logits_BLV, batch["targets"]).mean()

  g0 = unstack_layers(cfg, jax.grad(ce)(params))["layer_0"]
  np.testing.assert_allclose(m["telemetry/grad_rms/ffn"][0], _rms(g0["ffn"]), rtol=1e-3)
  np.testing.assert_allclose(m["telemetry/update_ratio/ffn"][0],
                             _rms(g0["ffn"]) / _rms(layer0["ffn"]), rtol=1e-3)
  assert m["telemetry/residual_rms"].shape == (cfg.num_layers,)
  assert np.all(np.asarray(m["telemetry/attn_update_rms"]) > 0)


def test_mla_reports_the_same_max_logit_from_both_impls_and_off_means_absent():
  cfg = CFG.replace(attention_type="mla", num_kv_heads=4, kv_lora_rank=16, qk_nope_head_dim=8,
                    qk_rope_head_dim=4, v_head_dim=8, attention_block_q=8,
                    attention_block_kv=8)
  batch = _batch(cfg)
  params = nn.unbox(Transformer(cfg).init(jax.random.key(1), batch["inputs"])["params"])
  got = {impl: _step(cfg.replace(attention_impl=impl), params, batch)
         for impl in ("xla", "blockwise")}
  np.testing.assert_allclose(got["xla"]["telemetry/attn_logit_max"],
                             got["blockwise"]["telemetry/attn_logit_max"], rtol=1e-5)
  off = _step(cfg, params, batch, telemetry=False)
  head = {"telemetry/logit_max", "telemetry/logit_mean", "telemetry/logz_mean"}
  assert {k for k in off if k.startswith("telemetry/")} == head  # Only the output head's.


def test_launch_logs_per_layer_telemetry_of_the_checkpointed_params(tmp_path):
  launch("--workdir", str(tmp_path), "--config.train.async_checkpoint=False",
         "--config.train.tensorboard=False", "--config.train.log_every=1",
         "--config.train.steps=2", "--config.train.checkpoint_every=1",
         "--config.train.eval_every=100", "--config.train.lr=0.05")
  assert json.load(open(tmp_path / "config.json"))["train"]["telemetry"] is True
  run = load_run(str(tmp_path), step=1)
  line = [r for r in run.metrics if r.get("split") == "train" and r["step"] == 2][0]
  n = run.model_config.num_layers
  for key in ("attn_logit_max", "residual_rms", "attn_update_rms", "ffn_update_rms",
              "grad_rms/attn", "param_rms/ffn", "update_ratio/attn"):
    assert [f"telemetry/{key}/L{i}" in line for i in range(n)] == [True] * n, key
  # Step 2's forward ran on checkpoint 1's parameters and the run's second batch.
  s = session.open_run(run.config, str(tmp_path), "eval")
  it = s.source.train_iterator(int(run.config.train.seed), run.config.data.batch_size,
                               run.config.data.seq_len)
  next(it)
  batch = jax.tree.map(jnp.asarray, next(it))
  params = run.variables["params"]
  np.testing.assert_allclose(line["telemetry/attn_logit_max/L0"],
                             direct_max_logit(run.model_config, params, batch), rtol=1e-4)
  layer1 = unstack_layers(run.model_config, params)[f"layer_{n - 1}"]
  np.testing.assert_allclose(line[f"telemetry/param_rms/attn/L{n - 1}"], _rms(layer1["attn"]),
                             rtol=1e-5)


def test_moe_router_telemetry_per_moe_layer_named_by_model_layer():
  from train.telemetry import per_layer_scalars  # pylint: disable=g-import-not-at-top
  cfg = CFG.replace(num_experts=4, experts_per_token=2, first_k_dense=1)
  batch = _batch(cfg)
  params = nn.unbox(Transformer(cfg).init(jax.random.key(1), batch["inputs"])["params"])
  m = jax.device_get(_step(cfg, params, batch))
  entropy, share = m["telemetry/router_entropy"], m["telemetry/expert_load_max"]
  assert entropy.shape == share.shape == (1,)  # One MoE layer: model layer 1.
  assert 0 < entropy[0] <= np.log(4) + 1e-6 and 0.25 <= share[0] <= 1.0
  np.testing.assert_allclose(entropy[0], m["moe_router_entropy/layer1"], rtol=1e-6)
  flat = per_layer_scalars(m, cfg.first_k_dense)
  assert flat["telemetry/router_entropy/L1"] == entropy[0]
  assert "telemetry/attn_logit_max/L0" in flat and "telemetry/attn_logit_max/L1" in flat

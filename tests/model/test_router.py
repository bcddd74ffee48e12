"""Router properties: top-R, gates, score functions, loss-free bias, group limits, losses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import ModelConfig
from model.moe import router as R

BASE = dict(vocab_size=64, d_model=16, num_layers=2, num_heads=2, num_kv_heads=2, mlp_dim=32,
            max_seq_len=32, num_experts=8, experts_per_token=2)


def make(**kw):
  return ModelConfig(**{**BASE, **kw})


def logits(seed=0, shape=(2, 5, 8)):
  return jax.random.normal(jax.random.key(seed), shape) * 2.0


def test_top_r_matches_sorting():
  s = np.asarray(R.scores_of(logits(), "softmax"))
  idx = np.asarray(R.select_experts(jnp.asarray(s), None, 3))
  np.testing.assert_array_equal(idx, np.argsort(-s, axis=-1)[..., :3])


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_gates_are_scores_of_chosen_experts(score):
  lg = logits()
  r = R.route(lg, None, make(router_score=score, router_norm_topk=False))
  fn = (lambda x: jax.nn.softmax(x, -1)) if score == "softmax" else jax.nn.sigmoid
  expected = np.take_along_axis(np.asarray(fn(lg)), np.asarray(r.indices_BLR), -1)
  np.testing.assert_allclose(r.gates_BLR, expected, rtol=1e-6)
  np.testing.assert_allclose(r.probs_BLE.sum(-1), 1.0, rtol=1e-6)  # both normalised for P_i
  if score == "sigmoid":  # Independent affinities: they do not sum to 1.
    assert not np.allclose(np.asarray(jax.nn.sigmoid(lg)).sum(-1), 1.0)


def test_renormalised_gates_sum_to_route_scale_and_match_mixtral():
  lg = logits()
  for score in ("softmax", "sigmoid"):
    r = R.route(lg, None, make(router_score=score, router_norm_topk=True, route_scale=2.5))
    np.testing.assert_allclose(r.gates_BLR.sum(-1), 2.5, rtol=1e-6)
  # Mixtral: renormalised softmax top-2 == softmax over the two chosen logits.
  r = R.route(lg, None, make(router_score="softmax", router_norm_topk=True))
  chosen = np.take_along_axis(np.asarray(lg), np.asarray(r.indices_BLR), -1)
  np.testing.assert_allclose(r.gates_BLR, jax.nn.softmax(chosen, -1), rtol=1e-5)


@pytest.mark.parametrize("norm", [False, True])
def test_bias_changes_selection_not_gate_values(norm):
  lg = logits()
  cfg = make(router_score="sigmoid", router_norm_topk=norm)
  bias = jnp.zeros(8).at[5].set(10.0)  # Forces expert 5 into every token's top 2.
  plain, biased = R.route(lg, None, cfg), R.route(lg, bias, cfg)
  assert (np.asarray(biased.indices_BLR) == 5).any(-1).all()
  assert not (np.asarray(plain.indices_BLR) == 5).any(-1).all()
  s = np.asarray(jax.nn.sigmoid(lg))
  g = np.take_along_axis(s, np.asarray(biased.indices_BLR), -1)  # unbiased scores
  if norm:
    g = g / g.sum(-1, keepdims=True)
  np.testing.assert_allclose(biased.gates_BLR, g, rtol=1e-6)
  np.testing.assert_array_equal(plain.probs_BLE, biased.probs_BLE)


def test_group_limited_routing_scores_groups_by_top2_sum():
  # 4 groups of 2. Group 0 has the single best expert but a poor second (sum 1.0);
  # groups 1 and 2 have two good experts each (sums 1.2, 1.4); group 3 is poor.
  s = jnp.array([0.95, 0.05, 0.6, 0.6, 0.7, 0.7, 0.1, 0.1])[None, None]
  idx = np.asarray(R.select_experts(s, None, 2, groups=4, topk_groups=2))
  assert sorted(idx.ravel().tolist()) == [4, 5]  # from group 2, the best group
  idx = np.asarray(R.select_experts(s, None, 3, groups=4, topk_groups=2))
  assert set(idx.ravel().tolist()) <= {2, 3, 4, 5} and 0 not in idx  # 0 is best, ineligible
  # Ungrouped, expert 0 wins.
  assert np.asarray(R.select_experts(s, None, 1))[0, 0, 0] == 0
  # The bias takes part in group selection too (DeepSeek-V3 scores biased affinities).
  bias = jnp.zeros(8).at[1].set(0.5)  # group 0 sum -> 1.5: now the best group
  idx = np.asarray(R.select_experts(s, bias, 2, groups=4, topk_groups=1))
  assert sorted(idx.ravel().tolist()) == [0, 1]


def test_group_limited_routing_random_picks_only_top_groups():
  s = R.scores_of(logits(1, (4, 16, 8)), "sigmoid")
  idx = np.asarray(R.select_experts(s, None, 3, groups=4, topk_groups=2))
  grouped = np.sort(np.asarray(s).reshape(4, 16, 4, 2), -1)[..., -2:].sum(-1)
  top_groups = np.argsort(-grouped, -1)[..., :2]
  for b in range(4):
    for t in range(16):
      assert set((idx[b, t] // 2).tolist()) <= set(top_groups[b, t].tolist())


def test_router_scores_float32_under_bfloat16_compute():
  cfg16, cfg32 = make(dtype="bfloat16"), make()
  x = jax.random.normal(jax.random.key(2), (2, 5, 16)).astype(jnp.bfloat16)
  params = R.Router(cfg16).init(jax.random.key(0), x)
  r16 = R.Router(cfg16).apply(params, x)
  r32 = R.Router(cfg32).apply(params, x.astype(jnp.float32))
  for a, b in zip(r16, r32):
    assert a.dtype == b.dtype and a.dtype in (jnp.float32, jnp.int32)
    np.testing.assert_array_equal(a, b)


def test_balance_losses_and_z_loss_against_hand_computation():
  # B=2 sequences, L=2 tokens, E=2 experts, R=1.
  idx = jnp.array([[[0], [0]], [[0], [1]]])
  probs = jnp.array([[[0.9, 0.1], [0.7, 0.3]], [[0.6, 0.4], [0.2, 0.8]]])
  counts = R.expert_counts(idx, 2)
  # Whole batch: f = (3/4, 1/4), P = (0.6, 0.4): 2 * (0.45 + 0.1) = 1.1
  np.testing.assert_allclose(R.balance_loss(counts, probs, per_sequence=False), 1.1, rtol=1e-6)
  # Per sequence: seq 0 f=(1,0), P=(.8,.2) -> 1.6; seq 1 f=(.5,.5), P=(.4,.6) -> 1.0; mean 1.3
  np.testing.assert_allclose(R.balance_loss(counts, probs, per_sequence=True), 1.3, rtol=1e-6)
  lg = logits()
  lse = np.log(np.exp(np.asarray(lg, np.float64)).sum(-1))
  np.testing.assert_allclose(R.z_loss(lg), np.mean(lse ** 2), rtol=1e-5)
  cfg = make(load_balance="aux_loss", aux_loss_coef=0.1, seq_aux_loss_coef=0.01,
             router_z_loss_coef=0.001)
  np.testing.assert_allclose(R.weighted_aux_loss(1.0, 2.0, 3.0, cfg), 0.1 + 0.02 + 0.003)
  # The Switch loss is only trained on under load_balance="aux_loss".
  np.testing.assert_allclose(R.weighted_aux_loss(1.0, 2.0, 3.0, cfg.replace(
      load_balance="loss_free")), 0.02 + 0.003)


def test_router_entropy_hand_values():
  uniform, certain = jnp.full((1, 2, 4), 0.25), jnp.eye(4)[None, :2]
  np.testing.assert_allclose(R.router_entropy(uniform), np.log(4), rtol=1e-6)
  np.testing.assert_allclose(R.router_entropy(certain), 0.0, atol=0)  # 0 log 0 = 0, no NaN
  mixed = jnp.array([[[0.5, 0.5, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]])
  np.testing.assert_allclose(R.router_entropy(mixed), np.log(2) / 2, rtol=1e-6)

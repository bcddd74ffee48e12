"""MoE layer properties: capacity and priority, dispatch paths == a naive loop over experts,
loss-free balancing, aux-collection functions, and the full Transformer with MoE layers."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import ModelConfig, Transformer
from model.moe import dispatch as D
from model.moe import layer as moe
from model.moe import router as R

B, L = 2, 6
BASE = dict(vocab_size=64, d_model=16, num_layers=2, num_heads=2, num_kv_heads=2, mlp_dim=32,
            max_seq_len=32, num_experts=4, experts_per_token=2, expert_mlp_dim=8)


def make(**kw):
  return ModelConfig(**{**BASE, **kw})


def inputs(seed=0, shape=(B, L, 16)):
  return jax.random.normal(jax.random.key(seed), shape)


def init(cfg, x):
  # Eager: jit-compiling the threefry initialisers costs more than running them.
  return nn.unbox(moe.MoE(cfg).init(jax.random.key(0), x))


def naive_moe(params, x_BLD, cfg):
  """Every token through each of its chosen experts, one expert at a time, no capacity."""
  p = params["params"]
  logits = jnp.einsum("BLD,DE->BLE", x_BLD, p["router"]["gate"]["w"])
  bias = params.get("moe_state", {}).get("router", {}).get("bias")
  routing = R.route(logits, bias, cfg)
  y = jnp.zeros_like(x_BLD)
  for e in range(cfg.num_experts):
    h = x_BLD @ p["wi"][e]
    h = jax.nn.silu(x_BLD @ p["wg"][e]) * h if cfg.ffn == "swiglu" else jax.nn.relu(h)
    weight_BL = jnp.sum(jnp.where(routing.indices_BLR == e, routing.gates_BLR, 0.0), -1)
    y = y + weight_BL[..., None] * (h @ p["wo"][e])
  return y


# Capacity ---------------------------------------------------------------------------
def test_capacity_formula():
  assert D.capacity(12, 2, 4, 1.0) == 6  # ceil(R * L * cf / E)
  assert D.capacity(12, 2, 4, 1.25) == 8  # 7.5 -> 8
  assert D.capacity(10, 2, 4, 1.2) == 6  # 6.000000000000001 in floats is still 6
  assert D.capacity(12, 2, 4, 0.0) == 12  # 0: no drops, C = L
  assert D.capacity(4, 2, 4, 100.0) == 4  # an expert never gets more than L pairs
  assert D.capacity(1, 2, 64, 0.01) == 1  # decode: one token, never dropped


# Hand-built routing, one sequence of 4 tokens, E=2, R=2, C=2. Rank-major queue:
#   first choices  t0->e0 (slot 0), t1->e1 (0), t2->e0 (1), t3->e0 (2: dropped)
#   second choices t0->e1 (1), t1->e0 (3: dropped), t2->e1 (2: dropped), t3->e1 (dropped)
# t1's second choice loses to t2's first choice although t1 comes first (first choices
# before second choices); t3's first choice loses to earlier tokens' first choices.
HAND_IDX = jnp.array([[[0, 1], [1, 0], [0, 1], [0, 1]]])
HAND_GATES = jnp.array([[[0.6, 0.4], [0.7, 0.3], [0.9, 0.1], [0.5, 0.5]]])
HAND_KEEP = np.array([[1, 1], [1, 0], [1, 0], [0, 0]])


def test_capacity_priority_and_dispatch_mask():
  dispatch, combine, kept = D.capacity_masks(HAND_IDX, HAND_GATES, 2, 2)
  expected, expected_combine = np.zeros((1, 4, 2, 2)), np.zeros((1, 4, 2, 2))
  for t, r, c in [(0, 0, 0), (2, 0, 1), (1, 0, 0), (0, 1, 1)]:  # (token, rank, slot) kept
    expected[0, t, HAND_IDX[0, t, r], c] = 1
    expected_combine[0, t, HAND_IDX[0, t, r], c] = HAND_GATES[0, t, r]
  np.testing.assert_array_equal(dispatch, expected)
  np.testing.assert_allclose(combine, expected_combine, rtol=1e-7)
  assert int(kept[0]) == HAND_KEEP.sum() == 4


def test_dropped_pairs_contribute_zero_and_fraction_is_exact():
  cfg = make(num_experts=2, d_model=8)
  x = inputs(1, (1, 4, 8))
  p = init(cfg, x)["params"]
  w = D.ExpertWeights(p["wi"], p["wg"], p["wo"])
  routing = R.Routing(HAND_IDX, HAND_GATES, jnp.full((1, 4, 2), 0.5), jnp.zeros((1, 4, 2)))
  y, dropped = jax.jit(D.auto_dispatch, static_argnums=(3, 4))(
      x, routing, w, "swiglu", 0.5)  # C = ceil(2 * 4 * 0.5 / 2) = 2
  assert float(dropped) == 0.5  # 4 of 8 pairs
  x_TD = np.asarray(x[0], np.float64)
  wi, wg, wo = (np.asarray(a, np.float64) for a in (p["wi"], p["wg"], p["wo"]))
  silu = lambda v: v / (1 + np.exp(-v))
  expected = np.zeros((4, 8))
  for t in range(4):
    for r in range(2):
      e = int(HAND_IDX[0, t, r])
      out = (silu(x_TD[t] @ wg[e]) * (x_TD[t] @ wi[e])) @ wo[e]
      expected[t] += HAND_KEEP[t, r] * float(HAND_GATES[0, t, r]) * out
  np.testing.assert_allclose(y[0], expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(y[0, 3], 0.0)  # both of t3's pairs dropped


# Dispatch paths == naive loop --------------------------------------------------------
PATHS = [dict(moe_dispatch="capacity"), dict(moe_dispatch="capacity", capacity_factor=8.0),
         dict(moe_dispatch="dropless"), dict(moe_dispatch="expert_parallel"),  # no mesh: local
         dict(moe_dispatch="expert_parallel_ragged"),  # no mesh: local dropless
         dict(moe_dispatch="dropless", ffn="relu", router_score="sigmoid", num_experts=8,
              router_groups=4, router_topk_groups=2, load_balance="loss_free")]


@pytest.mark.parametrize("kw", PATHS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_dispatch_equals_naive_loop_when_nothing_dropped(kw):
  cfg = make(**kw)
  x = inputs()
  params = init(cfg, x)
  if "moe_state" in params:  # a nonzero bias must steer the naive loop the same way
    params["moe_state"]["router"]["bias"] = jnp.linspace(-0.3, 0.3, cfg.num_experts)
  y, aux = jax.jit(lambda v, x: moe.MoE(cfg).apply(v, x, mutable=["aux"]))(params, x)
  np.testing.assert_allclose(y, naive_moe(params, x, cfg), rtol=1e-5, atol=1e-6)
  assert float(moe.moe_metrics(aux)["moe_dropped_frac"]) == 0.0


@pytest.mark.parametrize("dispatch", ["capacity", "dropless"])
def test_bfloat16_compute_close_to_naive_float32(dispatch):
  cfg = make(dtype="bfloat16", moe_dispatch=dispatch)
  x = inputs().astype(jnp.bfloat16)
  params = init(cfg, x)
  y = jax.jit(lambda v, x: moe.MoE(cfg).apply(v, x))(params, x)
  assert y.dtype == jnp.bfloat16
  ref = np.asarray(naive_moe(params, x.astype(jnp.float32), cfg.replace(dtype="float32")))
  assert np.abs(np.asarray(y, np.float32) - ref).max() < 2e-2 * np.abs(ref).max()


def test_large_capacity_equals_dropless_forward_and_grads():
  x = inputs(3)
  cap, drop = make(capacity_factor=8.0), make(moe_dispatch="dropless")
  params = init(cap, x)

  def loss(p, x, cfg):
    return jnp.sum(jnp.sin(moe.MoE(cfg).apply({"params": p}, x)))

  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)
  (l1, g1), (l2, g2) = grad(params["params"], x, cap), grad(params["params"], x, drop)
  np.testing.assert_allclose(l1, l2, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), g1, g2)


def test_train_and_eval_capacity_factors_and_decode_never_drops():
  cfg = make(capacity_factor=0.5, eval_capacity_factor=0.0)
  x = inputs()
  params = init(cfg, x)
  run = jax.jit(lambda v, x, det: moe.MoE(cfg).apply(v, x, det, mutable=["aux"])[1],
                static_argnums=2)
  frac = lambda aux: float(moe.moe_metrics(aux)["moe_dropped_frac"])
  assert frac(run(params, x, False)) > 0.0  # training factor 0.5 drops
  assert frac(run(params, x, True)) == 0.0  # eval factor 0: no drops
  assert frac(run(params, x[:, :1], False)) == 0.0  # one token per sequence: C = 1


def test_config_rejects_contradictions():
  with pytest.raises(ValueError, match="capacity_factor"):
    make(moe_dispatch="dropless", capacity_factor=1.0)
  with pytest.raises(ValueError, match="eval_capacity_factor"):
    make(eval_capacity_factor=-1.0)
  with pytest.raises(ValueError, match="capacity_factor=1.0: must be 0 with moe_dispatch="
                                       "'expert_parallel_ragged'"):
    make(moe_dispatch="expert_parallel_ragged", capacity_factor=1.0)
  with pytest.raises(ValueError, match="moe_dispatch"):
    make(moe_dispatch="ragged")


# Loss-free balancing -----------------------------------------------------------------
def test_bias_update_rule_sign_and_magnitude():
  cfg = make(load_balance="loss_free", bias_update_rate=0.1)
  state = {"moe_state": {"layers": {"ffn": {"router": {"bias": jnp.zeros((2, 4))}}}}}
  aux = {"aux": {"layers": {"ffn": {"router": {R.LOAD: (jnp.array([[1., 2., 3., 6.],
                                                                    [3., 3., 3., 3.]]),)}}}}}
  new = moe.update_moe_state(state, aux, cfg)["moe_state"]["layers"]["ffn"]["router"]["bias"]
  np.testing.assert_allclose(new, [[0.1, 0.1, 0.0, -0.1], [0.0, 0.0, 0.0, 0.0]], rtol=1e-6)
  # Identity unless loss-free balancing is on.
  assert moe.update_moe_state(state, aux, cfg.replace(load_balance="aux_loss")) is state


def test_router_bias_metrics_hand_values():
  # Unscanned layers at two paths: the norm is over all of them together.
  state = {"moe_state": {"layer_0": {"ffn": {"router": {"bias": jnp.array([3., 0., 0., 0.])}}},
                         "layer_1": {"ffn": {"router": {"bias": jnp.array([0., -4., 0., 0.])}}}}}
  got = moe.router_bias_metrics(state)
  assert set(got) == {"moe_bias_norm", "moe_bias_max"}
  np.testing.assert_allclose([got["moe_bias_norm"], got["moe_bias_max"]], [5.0, 4.0])
  assert moe.router_bias_metrics({}) == {}  # No loss-free balancing, no bias.


def test_bias_is_not_a_parameter():
  cfg = make(load_balance="loss_free")
  variables = init(cfg, inputs())
  paths = lambda tree: ["/".join(map(str, k)) for k, _ in
                        jax.tree_util.tree_flatten_with_path(tree)[0]]
  assert not any("bias" in p for p in paths(variables["params"]))
  assert paths(variables["moe_state"]) == ["['router']/['bias']"]
  assert variables["moe_state"]["router"]["bias"].dtype == jnp.float32


def test_loss_free_updates_reduce_maxvio():
  cfg = make(load_balance="loss_free", router_score="sigmoid", bias_update_rate=0.02,
             num_experts=8, experts_per_token=2)
  x = inputs(4, (4, 16, 16)) + 0.5
  variables = init(cfg, x)
  # An imbalanced router: logits offset by expert index through the input's mean.
  gate = variables["params"]["router"]["gate"]["w"]
  variables["params"]["router"]["gate"]["w"] = gate + jnp.linspace(-0.3, 0.3, 8)[None]
  apply = jax.jit(lambda v, x: moe.MoE(cfg).apply(v, x, mutable=["aux"])[1])
  state = {"moe_state": variables["moe_state"]}
  vios = []
  for _ in range(50):
    aux = apply({"params": variables["params"], **state}, x)
    vios.append(float(moe.maxvio(moe.expert_loads(aux))))
    state = moe.update_moe_state(state, aux, cfg)
  assert vios[0] > 1.0, vios[0]
  assert max(vios[-5:]) < 0.5 * vios[0], (vios[0], vios[-5:])


# Aux-collection functions -------------------------------------------------------------
def test_aux_functions_on_dense_model_are_neutral():
  cfg = make(num_experts=0)
  t = jnp.zeros((1, 4), jnp.int32)
  net = Transformer(cfg)
  # Structure only: a dense model's aux is empty, so shapes are all there is to see.
  _, mutated = jax.eval_shape(lambda: net.apply(net.init(jax.random.key(0), t), t,
                                                mutable=["aux"]))
  for aux in (mutated, mutated.get("aux", {})):
    assert float(moe.total_aux_loss(aux)) == 0.0
    assert moe.moe_metrics(aux) == {}
    assert moe.expert_loads(aux).shape == (0, 0) and float(moe.maxvio(moe.expert_loads(aux))) == 0
    assert moe.update_moe_state({}, aux, cfg.replace(num_experts=4,
                                                     load_balance="loss_free")) == {}


def test_maxvio_hand_values():
  np.testing.assert_allclose(moe.maxvio(jnp.array([[1., 1., 1., 1.], [0., 0., 2., 2.]])), 0.5)


def test_metrics_per_layer_in_layer_order_with_hand_values():
  # Unscanned layers as jit returns them: keys sorted as strings (layer_10 before layer_2).
  def layer(load, dropped):
    return {"ffn": {"router": {R.LOAD: (jnp.array(load),), R.LB_LOSS: (jnp.array(1.0),),
                               R.ENTROPY: (jnp.array(0.5),)},
                    moe.DROPPED: (jnp.array(dropped),)}}
  aux = {"layer_10": layer([4., 0., 0., 0.], 0.25), "layer_2": layer([1., 1., 1., 1.], 0.0),
         "layer_3": layer([2., 2., 0., 0.], 0.5)}
  m = moe.moe_metrics({"aux": aux}, first_layer=2)
  # MoE layers in model order: 2, 3, 10 -> "layer2", "layer3", "layer4" (first_layer + j).
  np.testing.assert_array_equal(moe.expert_loads(aux), [[1, 1, 1, 1], [2, 2, 0, 0], [4, 0, 0, 0]])
  expected = {"moe_maxvio/layer2": 0.0, "moe_maxvio/layer3": 1.0, "moe_maxvio/layer4": 3.0,
              "moe_dropped_frac/layer3": 0.5, "moe_dropped_frac/layer4": 0.25,
              "moe_maxvio": 4 / 3, "moe_dropped_frac": 0.25, "moe_lb_loss": 1.0,
              "moe_router_entropy": 0.5, "moe_router_entropy/layer4": 0.5}
  for key, value in expected.items():
    np.testing.assert_allclose(m[key], value, rtol=1e-6, err_msg=key)
  np.testing.assert_array_equal(m["moe_load/layer3"], [2, 2, 0, 0])
  np.testing.assert_allclose(m["moe_load"], [7 / 3, 1, 1 / 3, 1 / 3])  # sorted profile
  assert "moe_seq_loss" not in m  # not sown here: not invented
  assert len([k for k in m if k.startswith("moe_maxvio/")]) == 3


# Full Transformer ------------------------------------------------------------------------
def unscan(tree, segments):
  """Scanned variables -> the unscanned layout ({'layer_i': ...})."""
  out = {}
  for name, first, n, _ in segments:
    for i in range(n if name in tree else 0):
      out[f"layer_{first + i}"] = jax.tree.map(lambda a: a[i], tree[name])
  return {**{k: v for k, v in tree.items() if k not in {s[0] for s in segments}}, **out}


def test_transformer_with_moe_scanned_equals_unscanned():
  from model.transformer import layer_segments
  kw = dict(num_layers=3, first_k_dense=1, num_shared_experts=1, load_balance="loss_free",
            capacity_factor=1.0, seq_aux_loss_coef=0.01, router_z_loss_coef=1e-3)
  scanned, plain = make(scan_layers=True, **kw), make(scan_layers=False, **kw)
  t = jax.random.randint(jax.random.key(0), (B, 8), 0, 64)
  v = nn.unbox(Transformer(scanned).init(jax.random.key(0), t))
  assert set(v) == {"params", "moe_state"}  # init leaves no stale "aux" entries
  v["moe_state"] = jax.tree.map(lambda b: b + jnp.linspace(-0.2, 0.2, 4)[None], v["moe_state"])
  segs = layer_segments(scanned)
  v_plain = {k: unscan(x, segs) for k, x in v.items()}
  run = lambda cfg, v: Transformer(cfg).apply(v, t, deterministic=False, mutable=["aux"])
  y1, aux1 = jax.jit(lambda v: run(scanned, v))(v)
  y2, aux2 = jax.jit(lambda v: run(plain, v))(v_plain)
  np.testing.assert_allclose(y1, y2, rtol=1e-5, atol=1e-5)
  m1, m2 = moe.moe_metrics(aux1), moe.moe_metrics(aux2)
  assert set(m1) >= {"moe_maxvio", "moe_dropped_frac", "moe_lb_loss", "moe_seq_loss",
                     "moe_z_loss", "moe_router_entropy", "moe_load", "moe_load/layer0",
                     "moe_maxvio/layer1", "moe_router_entropy/layer1"}
  assert 0 < m1["moe_router_entropy"] <= np.log(4) + 1e-6
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), m1, m2)
  np.testing.assert_allclose(moe.expert_loads(aux1), moe.expert_loads(aux2))
  assert moe.expert_loads(aux1).shape == (2, 4)  # two MoE layers
  # 2 layers x (0.01 * seq + 1e-3 * z); the Switch loss is not trained under loss_free.
  np.testing.assert_allclose(moe.total_aux_loss(aux1), 2 * (0.01 * m1["moe_seq_loss"] +
                                                            1e-3 * m1["moe_z_loss"]), rtol=1e-5)
  s1 = moe.update_moe_state({"moe_state": v["moe_state"]}, aux1, scanned)
  s2 = moe.update_moe_state({"moe_state": v_plain["moe_state"]}, aux2, plain)
  jax.tree.map(np.testing.assert_allclose, unscan(s1["moe_state"], segs), s2["moe_state"])


# Sorted grouped computation (model/moe/grouped.py) ---------------------------------------
def test_blocked_grouped_matmul_equals_per_row_expert_with_grads():
  """Uneven and empty groups, and trailing rows past sum(sizes) (they must come out 0
  and get no gradient): each valid row is its own expert's matmul, forward and grads."""
  from model.moe import grouped
  sizes_E = jnp.array([5, 0, 9, 1], jnp.int32)  # 15 of 18 rows valid; blocks of 8 rows.
  x_PD = inputs(1, (18, 16))
  w_EDF = inputs(2, (4, 16, 8))
  expert_P = jnp.repeat(jnp.arange(4), sizes_E, total_repeat_length=18)
  valid_P = jnp.arange(18) < 15

  def blocked(x, w):
    y = grouped.grouped_ffn(x, sizes_E, lambda x_GbD, e_G: jnp.einsum(
        "Gbd,Gdf->Gbf", x_GbD, w[e_G]))
    return jnp.sum(jnp.sin(y)), y

  def reference(x, w):
    y = jnp.where(valid_P[:, None], jnp.einsum("pd,pdf->pf", x, w[expert_P]), 0.0)
    return jnp.sum(jnp.sin(y)), y

  vg = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(x_PD, w_EDF)
  (_, y1), g1 = vg(blocked)
  (_, y2), g2 = vg(reference)
  assert grouped.block_rows(18, 4) == grouped.MIN_BLOCK
  np.testing.assert_allclose(y1, y2, rtol=1e-5, atol=1e-6)
  assert not np.asarray(y1[15:]).any() and not np.asarray(g1[0][15:]).any()
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), g1, g2)


def test_default_capacity_factor_runs_sorted_and_equals_one_hot_buffers():
  """ModelConfig's default (capacity dispatch, factor 0 = never drop) runs the sorted
  grouped path on one device: the same numbers as the one-hot buffers of C = L."""
  cfg = make()
  assert cfg.moe_dispatch == "auto" and cfg.capacity_factor == 0
  x = inputs(4)
  params = init(cfg, x)
  p = params["params"]
  routing = R.route(jnp.einsum("BLD,DE->BLE", x, p["router"]["gate"]["w"]), None, cfg)
  w = D.ExpertWeights(p["wi"], p["wg"], p["wo"])
  one_hot, kept_B = D._capacity_compute(x, routing.indices_BLR, routing.gates_BLR, w,
                                        cfg.ffn, cfg.num_experts, L)
  y, dropped = D.auto_dispatch(x, routing, w, cfg.ffn, 0.0)
  np.testing.assert_allclose(y, one_hot, rtol=1e-5, atol=1e-6)
  assert int(kept_B.sum()) == B * L * 2 and float(dropped) == 0.0
  jaxpr = str(jax.make_jaxpr(lambda x: D.auto_dispatch(x, routing, w, cfg.ffn, 0.0))(x))
  assert "sort" in jaxpr and "ragged_dot" not in jaxpr  # sorted, blocked (CPU)


@pytest.mark.parametrize("cap", [1, 3, 12])  # Most pairs dropped, some, none.
def test_gathered_capacity_buffers_equal_the_one_hot_einsums(cap):
  """On one device the capacity path fills and reads its buffers by row gathers: the
  same outputs, kept counts and gradients as the one-hot dispatch / combine einsums."""
  cfg = make()
  x = inputs(5)
  p = init(cfg, x)["params"]
  routing = R.route(jnp.einsum("BLD,DE->BLE", x, p["router"]["gate"]["w"]), None, cfg)
  w = D.ExpertWeights(p["wi"], p["wg"], p["wo"])
  args = (routing.indices_BLR, routing.gates_BLR)

  def run(fn):
    loss = lambda x, w: (lambda y, k: (jnp.sum(jnp.sin(y)), (y, k)))(
        *fn(x, *args, w, cfg.ffn, cfg.num_experts, cap))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w)

  (_, (y1, k1)), g1 = run(D._capacity_gathered)
  (_, (y2, k2)), g2 = run(D._capacity_compute)
  np.testing.assert_allclose(y1, y2, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(k1, k2)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), g1, g2)

def test_capacity_dispatch_gathers_on_one_device(monkeypatch):
  cfg = make()
  x = inputs(6)
  p = init(cfg, x)["params"]
  routing = R.route(jnp.einsum("BLD,DE->BLE", x, p["router"]["gate"]["w"]), None, cfg)
  w = D.ExpertWeights(p["wi"], p["wg"], p["wo"])
  one_hot, _ = D._capacity_compute(x, routing.indices_BLR, routing.gates_BLR, w, cfg.ffn,
                                   cfg.num_experts, D.capacity(L, 2, cfg.num_experts, 1.0))

  def refuse(*_args, **_kw):
    raise AssertionError("the one-hot einsums ran on one device")
  monkeypatch.setattr(D, "_capacity_compute", refuse)
  y, _ = D.auto_dispatch(x, routing, w, cfg.ffn, 1.0)
  np.testing.assert_allclose(y, one_hot, rtol=1e-5, atol=1e-6)

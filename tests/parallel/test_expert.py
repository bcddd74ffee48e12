"""Expert parallelism on 8 simulated devices == the single-device computation.

The ragged (dropless) variant needs jax.lax.ragged_all_to_all, which XLA:CPU lacks: on
CPU its bookkeeping (offsets, sizes, regrouping, the way back, gradients) is checked with
a stand-in built from dense all_to_all that follows the documented semantics; the real
collective runs in the GPU / TPU test.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import ModelConfig, Transformer
from model.moe import layer as moe
from model.moe import dispatch as D
from parallel import expert, logical_rules, make_mesh, mesh_context
from tests.model.test_moe import naive_moe

BASE = dict(vocab_size=64, d_model=16, num_layers=2, num_heads=2, num_kv_heads=2, mlp_dim=32,
            max_seq_len=32, num_experts=8, experts_per_token=2, expert_mlp_dim=8,
            capacity_factor=1.0)  # C = ceil(2 * 8 * 1.0 / 8) = 2 of L = 8: some pairs drop


def make(**kw):
  return ModelConfig(**{**BASE, **kw})


def loss_and_grads(cfg, params, x):
  def loss(p, x):
    y, aux = moe.MoE(cfg).apply({"params": p}, x, deterministic=False, mutable=["aux"])
    return jnp.sum(jnp.sin(y)) + moe.total_aux_loss(aux), moe.moe_metrics(aux)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)


@pytest.mark.parametrize("mesh_cfg", [{"expert": 8}, {"data": 2, "expert": 4},
                                      {"data": 4, "expert": 2}],
                         ids=["expert8", "data2_expert4", "data4_expert2"])
def test_expert_parallel_equals_single_device_forward_and_grads(mesh_cfg):
  local, ep = make(load_balance="aux_loss"), make(load_balance="aux_loss",
                                                  moe_dispatch="expert_parallel")
  x = jax.random.normal(jax.random.key(1), (8, 8, 16))
  params = nn.unbox(moe.MoE(local).init(jax.random.key(0), x))["params"]
  (l1, m1), g1 = loss_and_grads(local, params, x)
  with jax.set_mesh(make_mesh(mesh_cfg)):
    assert expert.expert_axis_size() == mesh_cfg["expert"]
    (l2, m2), g2 = loss_and_grads(ep, params, x)
  assert float(m1["moe_dropped_frac"]) > 0  # the capacity limit is exercised
  np.testing.assert_allclose(l1, l2, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), m1, m2)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), g1, g2)


def test_transformer_expert_parallel_equals_capacity_under_mesh_and_rules():
  kw = dict(num_layers=2, first_k_dense=1, num_shared_experts=1)
  local, ep = make(**kw), make(moe_dispatch="expert_parallel", **kw)
  # 8 rows: expert parallelism holds each device's own rows (data x expert = 8 shards).
  t = jax.random.randint(jax.random.key(0), (8, 8), 0, 64)
  v = nn.unbox(Transformer(local).init(jax.random.key(0), t))
  y1 = jax.jit(lambda v: Transformer(local).apply(v, t))(v)
  mesh = make_mesh({"data": 2, "expert": 4})
  with mesh_context(mesh, logical_rules(mesh=mesh)):
    y2 = jax.jit(lambda v: Transformer(ep).apply(v, t))(v)
  np.testing.assert_allclose(y1, y2, rtol=1e-5, atol=1e-5)


def test_expert_parallel_config_errors():
  # Shapes only (eval_shape): the errors are raised while tracing, nothing compiles.
  x = jax.ShapeDtypeStruct((8, 4, 16), jnp.float32)
  ep, ep4 = make(moe_dispatch="expert_parallel"), make(moe_dispatch="expert_parallel",
                                                        num_experts=4)
  shapes = lambda cfg: jax.eval_shape(moe.MoE(cfg).init, jax.random.key(0), x)  # no mesh
  apply = lambda cfg, x: jax.eval_shape(lambda p, x: moe.MoE(cfg).apply(p, x), shapes(cfg), x)
  with jax.set_mesh(jax.make_mesh((8,), ("data",))):
    with pytest.raises(ValueError, match="mesh axis named 'expert'"):
      apply(ep, x)
  with jax.set_mesh(make_mesh({"expert": 8})):
    with pytest.raises(ValueError, match="batch size 4"):
      apply(ep, jax.ShapeDtypeStruct((4, 4, 16), jnp.float32))
    with pytest.raises(ValueError, match="num_experts=4"):
      apply(ep4, x)


def test_deprecated_mesh_context_is_an_error_not_a_silent_fallback():
  with pytest.warns(DeprecationWarning), make_mesh({"expert": 8}):
    with pytest.raises(ValueError, match="jax.set_mesh"):
      expert.expert_axis_size()
  assert expert.expert_axis_size() == 1  # no mesh at all: local computation


# Ragged (dropless) expert parallelism ------------------------------------------------
def ragged_all_to_all_dense(operand, output, input_offsets, send_sizes, output_offsets,
                            recv_sizes, *, axis_name):
  """jax.lax.ragged_all_to_all's documented semantics (one slice per device) from a dense
  all_to_all of zero-padded blocks: runs on CPU, ep times the bytes."""
  n = operand.shape[0]
  i = jnp.arange(n)
  rows = jnp.clip(input_offsets[:, None] + i[None], 0, n - 1)  # [ep, n] block d = to device d
  blocks = jnp.where((i[None] < send_sizes[:, None])[..., None], operand[rows], 0)
  received = jax.lax.all_to_all(blocks, axis_name, 0, 0, tiled=True)  # block s from device s
  # Where device s's block lands here: s's output_offsets[me].
  offsets = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
  dst = jnp.where(i[None] < recv_sizes[:, None], offsets[:, None] + i[None], output.shape[0])
  return output.at[dst.reshape(-1)].set(received.reshape(-1, *operand.shape[1:]), mode="drop")


def ragged_case():
  """(dropless config, ragged EP config, variables, x) with deliberately uneven routing:
  sigmoid scores plus a strong bias, so blocks differ in size across devices and some
  experts get no rows at all."""
  kw = dict(capacity_factor=0.0, load_balance="loss_free", router_score="sigmoid")
  local, ep = (make(moe_dispatch="dropless", **kw),
               make(moe_dispatch="expert_parallel_ragged", **kw))
  x = jax.random.normal(jax.random.key(2), (8, 8, 16))
  variables = nn.unbox(moe.MoE(local).init(jax.random.key(0), x))
  variables["moe_state"]["router"]["bias"] = jnp.array([2., 0, 0, -3, 1, 0, -3, 0])
  return local, ep, variables, x


def loss_and_grads_with_state(cfg, variables, x):
  state = {"moe_state": variables["moe_state"]}

  def loss(p, x):
    y, aux = moe.MoE(cfg).apply({"params": p, **state}, x, deterministic=False,
                                mutable=["aux"])
    return jnp.sum(jnp.sin(y)) + moe.total_aux_loss(aux), (y, moe.moe_metrics(aux))
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
      variables["params"], x)


def check_ragged(mesh_cfg):
  local, ep, variables, x = ragged_case()
  (l1, (y1, m1)), g1 = loss_and_grads_with_state(local, variables, x)
  with jax.set_mesh(make_mesh(mesh_cfg)):
    (l2, (y2, m2)), g2 = loss_and_grads_with_state(ep, variables, x)
  load = np.asarray(m1["moe_load/layer0"])
  assert load.min() == 0 and load.max() > 2 * load.mean(), load  # really uneven
  np.testing.assert_allclose(y2, naive_moe(variables, x, ep), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(y1, y2, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(l1, l2, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), m1, m2)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), g1, g2)


@pytest.mark.parametrize("mesh_cfg", [{"expert": 8}, {"data": 4, "expert": 2}],
                         ids=["expert8", "data4_expert2"])
def test_ragged_bookkeeping_with_dense_stand_in_equals_naive(mesh_cfg, monkeypatch):
  monkeypatch.setitem(D.DISPATCH, "expert_parallel_ragged", functools.partial(
      D.expert_parallel_ragged_dispatch, collective=ragged_all_to_all_dense))
  check_ragged(mesh_cfg)


@pytest.mark.skipif(jax.default_backend() == "cpu",
                    reason="jax.lax.ragged_all_to_all is not implemented on CPU in JAX 0.10 "
                           "(XLA:CPU has no ragged-all-to-all); runs on GPU / TPU")
@pytest.mark.parametrize("ep", [2, 4, 8])
def test_ragged_all_to_all_expert_parallel_equals_naive_on_accelerator(ep):
  if jax.device_count() < ep or jax.device_count() % ep:
    pytest.skip(f"needs a multiple of {ep} devices, have {jax.device_count()}")
  check_ragged({"data": jax.device_count() // ep, "expert": ep})


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU refusal")
def test_ragged_on_cpu_is_a_clear_error_naming_the_reason():
  _, ep, variables, x = ragged_case()
  with jax.set_mesh(make_mesh({"expert": 8})):
    with pytest.raises(NotImplementedError, match="ragged_all_to_all.*XLA:CPU"):
      jax.eval_shape(lambda v, x: moe.MoE(ep).apply(v, x), variables, x)
  with pytest.raises(ValueError, match="capacity_factor"):
    make(moe_dispatch="expert_parallel_ragged")  # BASE has capacity_factor=1.0


def test_ragged_without_expert_axis_is_local_dropless():
  local, ep, variables, x = ragged_case()  # no mesh: the local dropless computation
  y1, y2 = (jax.jit(lambda v, c=c: moe.MoE(c).apply(v, x))(variables) for c in (local, ep))
  np.testing.assert_array_equal(y1, y2)

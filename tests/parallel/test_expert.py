"""Expert parallelism on 8 simulated devices == the single-device capacity computation."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import ModelConfig, Transformer, moe
from parallel import expert, logical_rules, make_mesh, mesh_context

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


@pytest.mark.parametrize("mesh_cfg", [{"expert": 8}, {"data": 2, "expert": 4}],
                         ids=["expert8", "data2_expert4"])
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
  t = jax.random.randint(jax.random.key(0), (4, 8), 0, 64)
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

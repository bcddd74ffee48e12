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


# Tolerances of an expert-parallel result against the one-device one, per compute dtype:
# float32 differs in summation order only; bfloat16 also rounds partial sums that the two
# programs split differently (the expert weights' gradient summed over the data axis).
# The test losses are sums of sin(y) over 1,024 outputs, near zero: bfloat16 gets an
# absolute bound too.
TOL = {"float32": dict(loss=1e-5, loss_atol=0.0, grad=1e-4),
       "bfloat16": dict(loss=1e-2, loss_atol=1e-3, grad=5e-2)}


def assert_grads_close(got, want, rtol):
  """Each gradient leaf to `rtol` of its largest entry (bfloat16 rounds small entries)."""
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * float(np.abs(w).max()) + 1e-7,
                               err_msg=jax.tree_util.keystr(path))


def loss_and_grads(cfg, params, x):
  def loss(p, x):
    y, aux = moe.MoE(cfg).apply({"params": p}, x, deterministic=False, mutable=["aux"])
    return jnp.sum(jnp.sin(y)) + moe.total_aux_loss(aux), moe.moe_metrics(aux)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)


@pytest.mark.parametrize("mesh_cfg,dtype", [
    ({"expert": 8}, "float32"), ({"data": 2, "expert": 4}, "float32"),
    ({"data": 4, "expert": 2}, "float32"), ({"data": 2, "expert": 4}, "bfloat16"),
    ({"data": 2, "fsdp": 2, "expert": 2}, "bfloat16")],
    ids=["expert8", "data2_expert4", "data4_expert2", "data2_expert4_bf16",
         "data2_fsdp2_expert2_bf16"])
def test_expert_parallel_equals_single_device_forward_and_grads(mesh_cfg, dtype):
  """bfloat16 compute, float32 parameters (as the CLI trains): before the weights entered
  the shard_map in float32 on CPU (model/moe/dispatch.py `_wire`), XLA:CPU aborted the
  process compiling this gradient. Minimal reproducer (jaxlib 0.10.2, 8 CPU devices):

      mesh = jax.make_mesh((2, 4, 1), ("data", "expert", "tensor"),
                           axis_types=(jax.sharding.AxisType.Auto,) * 3)
      def f(x, w):  # x [16, 8], w [4, 8, 8], both bfloat16
        local = lambda x, w: jnp.einsum("bd,edf->bf", x, w)
        return jax.shard_map(local, in_specs=(P(("data", "expert")), P("expert")),
                             out_specs=P(("data", "expert")), axis_names={"data", "expert"},
                             check_vma=False)(x, w).sum()
      with jax.set_mesh(mesh):
        jax.jit(jax.grad(f, argnums=1))(x, w)
      # F hlo_instruction.cc:1615] Invalid binary instruction opcode copy

  w's gradient is psummed over "data" in bfloat16; with "tensor" left Auto its reduction
  computation ends in a Shardy sharding custom-call (later a copy), which AllReducePromotion
  cannot clone. float32, or every mesh axis manual, compiles."""
  tol = TOL[dtype]
  local, ep = (make(load_balance="aux_loss", dtype=dtype),
               make(load_balance="aux_loss", moe_dispatch="expert_parallel", dtype=dtype))
  x = jax.random.normal(jax.random.key(1), (8, 8, 16))
  params = nn.unbox(moe.MoE(local).init(jax.random.key(0), x))["params"]
  (l1, m1), g1 = loss_and_grads(local, params, x)
  with jax.set_mesh(make_mesh(mesh_cfg)):
    assert expert.expert_axis_size() == mesh_cfg["expert"]
    (l2, m2), g2 = loss_and_grads(ep, params, x)
  assert float(m1["moe_dropped_frac"]) > 0  # the capacity limit is exercised
  np.testing.assert_allclose(l1, l2, rtol=tol["loss"], atol=tol["loss_atol"])
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=tol["loss"]), m1, m2)
  assert_grads_close(g2, g1, tol["grad"])


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


def ragged_case(dtype: str = "float32"):
  """(dropless config, ragged EP config, variables, x) with deliberately uneven routing:
  sigmoid scores plus a strong bias, so blocks differ in size across devices and some
  experts get no rows at all."""
  kw = dict(capacity_factor=0.0, load_balance="loss_free", router_score="sigmoid",
            dtype=dtype)
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


def check_ragged(mesh_cfg, dtype: str = "float32"):
  local, ep, variables, x = ragged_case(dtype)
  (l1, (y1, m1)), g1 = loss_and_grads_with_state(local, variables, x)
  with jax.set_mesh(make_mesh(mesh_cfg)):
    (l2, (y2, m2)), g2 = loss_and_grads_with_state(ep, variables, x)
  load = np.asarray(m1["moe_load/layer0"])
  assert load.min() == 0 and load.max() > 2 * load.mean(), load  # really uneven
  if dtype == "float32":
    np.testing.assert_allclose(y2, naive_moe(variables, x, ep), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y1, y2, rtol=1e-5, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), m1, m2)
  else:  # The same routing (float32 router), outputs to bfloat16 rounding.
    np.testing.assert_array_equal(m1["moe_load/layer0"], m2["moe_load/layer0"])
    y1, y2 = np.asarray(y1, np.float32), np.asarray(y2, np.float32)
    np.testing.assert_allclose(y2, y1, rtol=2e-2, atol=2e-2 * float(np.abs(y1).max()))
  np.testing.assert_allclose(l1, l2, rtol=TOL[dtype]["loss"], atol=TOL[dtype]["loss_atol"])
  assert_grads_close(g2, g1, TOL[dtype]["grad"])


@pytest.mark.parametrize("mesh_cfg,dtype", [({"expert": 8}, "float32"),
                                            ({"data": 4, "expert": 2}, "float32"),
                                            ({"data": 2, "expert": 4}, "bfloat16")],
                         ids=["expert8", "data4_expert2", "data2_expert4_bf16"])
def test_ragged_bookkeeping_with_dense_stand_in_equals_naive(mesh_cfg, dtype, monkeypatch):
  monkeypatch.setitem(D.DISPATCH, "expert_parallel_ragged", functools.partial(
      D.expert_parallel_ragged_dispatch, collective=ragged_all_to_all_dense))
  check_ragged(mesh_cfg, dtype)


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

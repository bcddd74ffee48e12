"""Sharded init == unsharded init, with the rules' specs; batch sharding; global batches."""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from parallel import mesh as mesh_lib
from parallel import rules as rules_lib
from parallel import sharding

P = jax.sharding.PartitionSpec
B, L, D, F, V = 8, 4, 16, 32, 64


def _normal(names):
  return nn.with_logical_partitioning(nn.initializers.uniform(0.4), names)


class Einsum(nn.Module):
  """The model's projection layer in miniature: a weight declared where it is used."""
  shape: tuple[int, ...]
  names: tuple[str, ...]
  eqn: str

  @nn.compact
  def __call__(self, x):
    return jnp.einsum(self.eqn, x, self.param("w", _normal(self.names), self.shape))


class Block(nn.Module):

  @nn.compact
  def __call__(self, x_BLD, _=None):
    h_BLF = Einsum((D, F), ("embed", "mlp"), "BLD,DF->BLF", name="mlp_in")(x_BLD)
    h_BLF = nn.with_logical_constraint(jax.nn.gelu(h_BLF), ("batch", "length", "mlp"))
    y_BLD = Einsum((F, D), ("mlp", "embed"), "BLF,FD->BLD", name="mlp_out")(h_BLF)
    scale_D = self.param("scale", _normal(("embed",)), (D,))
    bias_D = self.param("bias", nn.initializers.uniform(0.4), (D,))  # No names: replicated.
    out_BLD = x_BLD + y_BLD * scale_D[None, None, :] + bias_D[None, None, :]
    return nn.with_logical_constraint(out_BLD, ("batch", "length", "embed")), None


class Tiny(nn.Module):
  scanned: bool = False

  @nn.compact
  def __call__(self, tokens_BL):
    table_VD = self.param("embedding", _normal(("vocab", "embed")), (V, D))
    # Gather whole rows: a gather from fsdp-split rows makes GSPMD replicate its output.
    x_BLD = nn.with_logical_constraint(table_VD, ("vocab", None))[tokens_BL]
    x_BLD = nn.with_logical_constraint(x_BLD, ("batch", "length", "embed"))
    if self.scanned:
      stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                      length=2, metadata_params={nn.PARTITION_NAME: "layers"})
      x_BLD, _ = stack(name="layers")(x_BLD, None)
    else:
      x_BLD, _ = Block(name="block")(x_BLD)
    return jnp.einsum("BLD,VD->BLV", x_BLD, self.param("unembed", _normal(("vocab", "embed")),
                                                      (V, D)))


def _setup(preset="dp_fsdp_tp"):
  mesh = mesh_lib.make_mesh(rules_lib.PRESETS[preset])
  return mesh, rules_lib.logical_rules(mesh=mesh)


def _block_shape(shape, spec, mesh):
  out = []
  for n, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    axes = (axes,) if isinstance(axes, str) else axes or ()
    out.append(n // math.prod(mesh.shape[a] for a in axes))
  return tuple(out)


def _flat(tree):
  return {"/".join(k.key for k in path): x
          for path, x in jax.tree_util.tree_leaves_with_path(tree)}


TOKENS_BL = jnp.arange(B * L, dtype=jnp.int32).reshape(B, L) % V
KEY = jax.random.key(0)


@functools.cache
def _reference(scanned: bool):
  """Unboxed variables and logits of an unsharded init on one device (compiled once)."""
  model = Tiny(scanned)
  variables = nn.unbox(jax.jit(model.init)(KEY, TOKENS_BL))
  return variables, jax.jit(model.apply)(variables, TOKENS_BL)


@pytest.mark.parametrize("scanned, lead", [(False, ()), (True, (None,))])
def test_sharded_init_equals_unsharded_with_rule_specs(scanned, lead):
  mesh, rules = _setup()  # data=2, fsdp=2, tensor=2
  variables, shardings = sharding.sharded_init(Tiny(scanned).init, KEY, TOKENS_BL,
                                               mesh=mesh, rules=rules)
  block = "layers" if scanned else "block"
  want = {
      "embedding": P("tensor", "fsdp"), "unembed": P("tensor", "fsdp"),
      f"{block}/mlp_in/w": P(*lead, "fsdp", "tensor"),
      f"{block}/mlp_out/w": P(*lead, "tensor", "fsdp"),
      f"{block}/scale": P(*lead, "fsdp"), f"{block}/bias": P(),
  }
  flat = _flat(variables["params"])
  assert set(flat) == set(want)
  ref_flat = _flat(_reference(scanned)[0]["params"])
  for name, x in flat.items():
    assert x.sharding == jax.NamedSharding(mesh, want[name]), name
    # The full parameter never sits on one device: each holds only its block.
    assert x.addressable_shards[0].data.shape == _block_shape(x.shape, want[name], mesh)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(ref_flat[name]), err_msg=name)
  assert shardings == jax.tree.map(lambda x: x.sharding, variables)


@pytest.mark.parametrize("preset", ["dp_fsdp_tp", "tp", "ep"])  # Every axis in use.
def test_sharded_forward_equals_single_device(preset):
  """The rules only move data: logits on a sharded mesh match one device's."""
  mesh, rules = _setup(preset)
  model = Tiny()
  abstract = jax.eval_shape(model.init, KEY, TOKENS_BL)
  shardings = sharding.logical_to_mesh_sharding(abstract, mesh, rules)
  reference, want_BLV = _reference(False)
  variables = jax.device_put(reference, shardings)
  batch_sharding = sharding.batch_sharding(mesh, rules)
  tokens_BL = sharding.host_local_to_global(np.asarray(TOKENS_BL), mesh, batch_sharding)
  with sharding.mesh_context(mesh, rules):
    logits_BLV = jax.jit(model.apply, in_shardings=(shardings, batch_sharding))(
        variables, tokens_BL)
  np.testing.assert_allclose(np.asarray(logits_BLV), np.asarray(want_BLV),
                             rtol=1e-5, atol=1e-5)


def test_unknown_logical_name_is_an_error():
  mesh, rules = _setup()
  tree = {"w": nn.LogicallyPartitioned(jax.ShapeDtypeStruct((4, 4), "float32"),
                                       ("embed", "kv_head"))}
  with pytest.raises(ValueError, match="kv_head"):
    sharding.logical_to_mesh_sharding(tree, mesh, rules)


@pytest.mark.parametrize("preset, spec", [
    ("dp", P("data", None)), ("fsdp", P("fsdp", None)), ("tp", P(None, None)),
    ("dp_fsdp_tp", P(("data", "fsdp"), None)), ("ep", P("expert", None)),
])
def test_batch_sharding(preset, spec):
  mesh, rules = _setup(preset)
  assert sharding.batch_sharding(mesh, rules) == jax.NamedSharding(mesh, spec)


def test_host_local_to_global_single_process():
  mesh, rules = _setup()
  spec = sharding.batch_sharding(mesh, rules)
  assert sharding.host_batch_slice(spec, B) == slice(0, B)  # One process holds all rows.
  batch = {"inputs": np.arange(B * L).reshape(B, L), "mask": np.ones((B, L), bool)}
  out = sharding.host_local_to_global(batch, mesh, spec)
  for name in batch:
    assert out[name].sharding == spec
    np.testing.assert_array_equal(np.asarray(out[name]), batch[name])
    assert out[name].addressable_shards[0].data.shape == (B // 4, L)  # data*fsdp = 4.
  other = mesh_lib.make_mesh({"data": -1}, devices=jax.devices()[:4])
  with pytest.raises(ValueError, match="not the given mesh"):
    sharding.host_local_to_global(batch, other, spec)


def test_optimizer_state_inherits_param_shardings():
  """Building the optimizer state inside init_fn shards the moments like the params."""
  mesh, rules = _setup()
  layer = Einsum((D, F), ("embed", "mlp"), "BLD,DF->BLF")
  tx = optax.adam(1e-3)

  def init_fn(key):
    params = layer.init(key, jnp.zeros((1, 1, D)))["params"]
    return params, tx.init(params)

  (params, opt_state), _ = sharding.sharded_init(init_fn, KEY, mesh=mesh, rules=rules)
  want = jax.NamedSharding(mesh, P("fsdp", "tensor"))
  assert params["w"].sharding == want
  assert opt_state[0].mu["w"].sharding == want and opt_state[0].nu["w"].sharding == want
  assert opt_state[0].count.sharding.is_fully_replicated

"""The rules table: size-1 axes dropped, GQA fallbacks, and pinned specs per preset."""

import flax.linen as nn
import jax
import pytest

from parallel import mesh as mesh_lib
from parallel import rules as rules_lib
from parallel import sharding

N, K = 8, 2  # Query / KV heads of the representative model (GQA).
D, F, V, E, H, A = 16, 32, 64, 8, 4, 8

# name: logical axes; the shapes are small multiples of every preset's axis sizes.
PARAMS = {
    "embedding": (("vocab", "embed"), (V, D)),
    "pos_embedding": ((None, "embed"), (32, D)),
    "q": (("embed", "heads", "head_dim"), (D, N, H)),
    "k": (("embed", "kv_heads", "head_dim"), (D, K, H)),
    "v": (("embed", "kv_heads", "head_dim"), (D, K, H)),
    "o": (("heads", "head_dim", "embed"), (N, H, D)),
    "mlp_in": (("embed", "mlp"), (D, F)),
    "mlp_out": (("mlp", "embed"), (F, D)),
    "norm": (("embed",), (D,)),
    "qk_norm": (("head_dim",), (H,)),
    "router": (("embed", None), (D, E)),
    "expert_in": (("expert", "expert_embed", "mlp"), (E, D, F)),
    "expert_out": (("expert", "mlp", "expert_embed"), (E, F, D)),
    "unembedding": (("embed", "vocab"), (D, V)),
    "mla_down": (("embed", "latent"), (D, A)),  # model/attention/mla.py's q_a / kv_a
    "mla_up": (("latent", "heads", "head_dim"), (A, N, H)),  # its q_nope / k_up / v_up
    "latent_norm": (("latent",), (A,)),
}
ACTIVATIONS = {
    "tokens": ("batch", "length"),
    "x": ("batch", "length", "embed"),
    "q": ("batch", "length", "heads", "head_dim"),
    "kv": ("batch", "length", "kv_heads", "head_dim"),
    "hidden": ("batch", "length", "mlp"),
    "logits": ("batch", "length", "vocab"),
    "dispatched": ("expert", None, "expert_embed"),
    "latent": ("batch", "length", "latent"),
    "stream": ("batch", "length", "residual"),  # Between layers (model/transformer.py).
}

DF = ("data", "fsdp")
# On 8 devices. A change to the rules table shows up here as a diff: update it on purpose.
GOLDEN_PARAMS = {
    "dp": {name: (None,) * len(names) for name, (names, _) in PARAMS.items()},
    "fsdp": {
        "embedding": (None, "fsdp"), "pos_embedding": (None, "fsdp"),
        "q": ("fsdp", None, None), "k": ("fsdp", None, None), "v": ("fsdp", None, None),
        "o": (None, None, "fsdp"), "mlp_in": ("fsdp", None), "mlp_out": (None, "fsdp"),
        "norm": ("fsdp",), "qk_norm": (None,), "router": ("fsdp", None),
        "expert_in": (None, "fsdp", None), "expert_out": (None, None, "fsdp"),
        "unembedding": ("fsdp", None),
        "mla_down": ("fsdp", None), "mla_up": ("fsdp", None, None), "latent_norm": ("fsdp",),
    },
    "tp": {  # tensor=8 divides N=8 but not K=2: KV heads are replicated.
        "embedding": ("tensor", None), "pos_embedding": (None, None),
        "q": (None, "tensor", None), "k": (None, None, None), "v": (None, None, None),
        "o": ("tensor", None, None), "mlp_in": (None, "tensor"), "mlp_out": ("tensor", None),
        "norm": (None,), "qk_norm": (None,), "router": (None, None),
        "expert_in": (None, None, "tensor"), "expert_out": (None, "tensor", None),
        "unembedding": (None, "tensor"),
        "mla_down": (None, None), "mla_up": (None, "tensor", None), "latent_norm": (None,),
    },
    "dp_fsdp_tp": {
        "embedding": ("tensor", "fsdp"), "pos_embedding": (None, "fsdp"),
        "q": ("fsdp", "tensor", None), "k": ("fsdp", "tensor", None),
        "v": ("fsdp", "tensor", None), "o": ("tensor", None, "fsdp"),
        "mlp_in": ("fsdp", "tensor"), "mlp_out": ("tensor", "fsdp"),
        "norm": ("fsdp",), "qk_norm": (None,), "router": ("fsdp", None),
        "expert_in": (None, "fsdp", "tensor"), "expert_out": (None, "tensor", "fsdp"),
        "unembedding": ("fsdp", "tensor"),
        "mla_down": ("fsdp", None), "mla_up": ("fsdp", "tensor", None),
        "latent_norm": ("fsdp",),
    },
    "ep": {  # Outside the experts, D (and MLA's latent) ZeRO-split over expert.
        "embedding": (None, "expert"), "pos_embedding": (None, "expert"),
        "q": ("expert", None, None), "k": ("expert", None, None), "v": ("expert", None, None),
        "o": (None, None, "expert"), "mlp_in": ("expert", None), "mlp_out": (None, "expert"),
        "norm": ("expert",), "qk_norm": (None,), "router": ("expert", None),
        "expert_in": ("expert", None, None), "expert_out": ("expert", None, None),
        "unembedding": ("expert", None),
        "mla_down": ("expert", None), "mla_up": ("expert", None, None),
        "latent_norm": ("expert",),
    },
    "dp_cp": {name: (None,) * len(names) for name, (names, _) in PARAMS.items()},
}
GOLDEN_ACTIVATIONS = {
    "dp": {"tokens": ("data", None), "x": ("data", None, None),
           "q": ("data", None, None, None), "kv": ("data", None, None, None),
           "hidden": ("data", None, None), "logits": ("data", None, None),
           "dispatched": (None, None, None), "latent": ("data", None, None),
           "stream": ("data", None, None)},
    "fsdp": {"tokens": ("fsdp", None), "x": ("fsdp", None, None),
             "q": ("fsdp", None, None, None), "kv": ("fsdp", None, None, None),
             "hidden": ("fsdp", None, None), "logits": ("fsdp", None, None),
             "dispatched": (None, None, "fsdp"), "latent": ("fsdp", None, None),
             "stream": ("fsdp", None, None)},
    "tp": {"tokens": (None, None), "x": (None, None, None),
           "q": (None, None, "tensor", None), "kv": (None, None, None, None),
           "hidden": (None, None, "tensor"), "logits": (None, None, "tensor"),
           "dispatched": (None, None, None), "latent": (None, None, None),
           "stream": (None, None, "tensor")},
    "dp_fsdp_tp": {"tokens": (DF, None), "x": (DF, None, None),
                   "q": (DF, None, "tensor", None), "kv": (DF, None, "tensor", None),
                   "hidden": (DF, None, "tensor"), "logits": (DF, None, "tensor"),
                   "dispatched": (None, None, "fsdp"), "latent": (DF, None, None),
                   "stream": (DF, None, "tensor")},
    "ep": {"tokens": ("expert", None), "x": ("expert", None, None),
           "q": ("expert", None, None, None), "kv": ("expert", None, None, None),
           "hidden": ("expert", None, None), "logits": ("expert", None, None),
           "dispatched": ("expert", None, None), "latent": ("expert", None, None),
           "stream": ("expert", None, None)},
    "dp_cp": {"tokens": ("data", "context"), "x": ("data", "context", None),
              "q": ("data", "context", None, None), "kv": ("data", "context", None, None),
              "hidden": ("data", "context", None), "logits": ("data", "context", None),
              "dispatched": (None, None, None), "latent": ("data", "context", None),
              "stream": ("data", "context", None)},
}


def _param_specs(preset: str, layers: bool) -> dict:
  mesh = mesh_lib.make_mesh(rules_lib.PRESETS[preset])
  rules = rules_lib.logical_rules(mesh=mesh, num_kv_heads=K, num_heads=N)
  lead_names, lead_shape = (("layers",), (3,)) if layers else ((), ())
  tree = {name: nn.LogicallyPartitioned(
              jax.ShapeDtypeStruct(lead_shape + shape, "float32"), lead_names + names)
          for name, (names, shape) in PARAMS.items()}
  shardings = sharding.logical_to_mesh_sharding(tree, mesh, rules)
  return {name: tuple(s.spec) for name, s in shardings.items()}


def test_presets_cover_the_golden_tables():
  assert set(rules_lib.PRESETS) == set(GOLDEN_PARAMS) == set(GOLDEN_ACTIVATIONS)


@pytest.mark.parametrize("preset", sorted(rules_lib.PRESETS))
def test_golden_param_specs(preset):
  assert _param_specs(preset, layers=False) == GOLDEN_PARAMS[preset]


@pytest.mark.parametrize("preset", sorted(rules_lib.PRESETS))
def test_scanned_layers_axis_is_never_sharded(preset):
  want = {name: (None,) + spec for name, spec in GOLDEN_PARAMS[preset].items()}
  assert _param_specs(preset, layers=True) == want


@pytest.mark.parametrize("preset", sorted(rules_lib.PRESETS))
def test_golden_activation_specs(preset):
  mesh = mesh_lib.make_mesh(rules_lib.PRESETS[preset])
  rules = rules_lib.logical_rules(mesh=mesh, num_kv_heads=K, num_heads=N)
  got = {name: tuple(nn.logical_to_mesh_axes(names, rules))
         for name, names in ACTIVATIONS.items()}
  assert got == GOLDEN_ACTIVATIONS[preset]


def test_table_names_each_logical_name_once_batch_first():
  rules = rules_lib.logical_rules({"data": -1})
  assert tuple(name for name, _ in rules) == rules_lib.LOGICAL_NAMES
  assert rules[0][0] == "batch"  # Activations' "embed" must yield fsdp to "batch".


@pytest.mark.parametrize("cfg", [*rules_lib.PRESETS.values(),
                                 {"data": 2, "fsdp": 4}, {"fsdp": 2, "expert": -1}])
def test_size_one_axes_are_dropped(cfg):
  sizes = mesh_lib.mesh_shape(cfg, jax.device_count())
  for name, axes in rules_lib.logical_rules(cfg):
    used = (axes,) if isinstance(axes, str) else axes or ()
    assert all(sizes[a] > 1 for a in used), (name, axes, sizes)


def test_data_only_mesh_replicates_every_param():
  rules = rules_lib.logical_rules({"data": -1})
  assert {axes for name, axes in rules if name != "batch"} == {None}


@pytest.mark.parametrize("num_heads, num_kv_heads, heads, kv_heads", [
    (8, 8, "tensor", "tensor"),  # MHA
    (8, 4, "tensor", "tensor"),  # GQA, K divisible by tensor=4
    (8, 2, "tensor", None),      # GQA, K=2 < tensor=4: replicate KV heads
    (8, 1, "tensor", None),      # MQA
    (6, 2, None, None),          # N=6 not divisible by 4 either
    (None, None, "tensor", "tensor"),  # Unknown counts: shard and let the model check.
])
def test_heads_fall_back_to_replication(num_heads, num_kv_heads, heads, kv_heads):
  rules = dict(rules_lib.logical_rules({"data": -1, "tensor": 4}, num_kv_heads=num_kv_heads,
                                       num_heads=num_heads))
  assert (rules["heads"], rules["kv_heads"]) == (heads, kv_heads)


def test_mesh_argument_wins_over_config():
  mesh = mesh_lib.make_mesh({"fsdp": -1}, devices=jax.devices()[:2])
  assert dict(rules_lib.logical_rules({"tensor": -1}, mesh=mesh))["embed"] == "fsdp"
  cfg = {"fsdp": -1, "tensor": 2}
  assert rules_lib.logical_rules(cfg) == rules_lib.logical_rules(
      None, mesh=mesh_lib.make_mesh(cfg))


@pytest.mark.parametrize("kwargs, word", [
    ({}, "mesh_cfg or mesh"),
    ({"mesh_cfg": {"data": -1}, "num_kv_heads": 0}, "num_kv_heads=0"),
    ({"mesh_cfg": {"data": -1}, "num_heads": -2}, "num_heads=-2"),
])
def test_bad_arguments(kwargs, word):
  with pytest.raises(ValueError, match=word):
    rules_lib.logical_rules(**kwargs)


def test_fsdp_by_expert_splits_the_experts_over_expert_and_all_else_over_both():
  """fsdp 2 x expert 4 (DeepSeek-V3's fsdp x expert layout, MaxText's embed and
  embed_no_exp): the routed experts split by expert and their D over fsdp; every other
  weight's D, and MLA's latent, over all 8 chips, so none is whole on an expert group."""
  mesh = mesh_lib.make_mesh({"fsdp": 2, "expert": 4})
  rules = rules_lib.logical_rules(mesh=mesh, num_kv_heads=K, num_heads=N)
  tree = {name: nn.LogicallyPartitioned(jax.ShapeDtypeStruct(shape, "float32"), names)
          for name, (names, shape) in PARAMS.items()}
  specs = {name: tuple(s.spec)
           for name, s in sharding.logical_to_mesh_sharding(tree, mesh, rules).items()}
  both = ("fsdp", "expert")
  assert specs["expert_in"] == ("expert", "fsdp", None)
  assert specs["expert_out"] == ("expert", None, "fsdp")
  assert specs["q"] == (both, None, None) and specs["mlp_out"] == (None, both)
  assert specs["router"] == (both, None) and specs["unembedding"] == (both, None)
  assert specs["mla_down"] == (both, None) and specs["mla_up"] == (both, None, None)

"""blockwork variables <-> HF tensors: exact round trips for every layout, loud refusals."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from interop.hf_config import pick_architecture
from interop.hf_weights import check_shapes, hf_to_variables, variables_to_hf
from model import ModelConfig, Transformer

BASE = dict(vocab_size=64, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, mlp_dim=48,
            max_seq_len=32)
CONFIGS = {
    "llama": dict(),
    "qwen2-tied-unscanned": dict(attn_bias=True, tie_embeddings=True, scan_layers=False),
    "phi3-partial": dict(rope_fraction=0.5),
    "mixtral": dict(num_experts=4, expert_mlp_dim=16),
    "glm4moe": dict(num_experts=4, expert_mlp_dim=16, router_score="sigmoid",
                    num_shared_experts=2, first_k_dense=1, load_balance="loss_free",
                    qk_norm=True, attn_bias=True, router_groups=2),
}


def init(cfg, seed=0):
  """Random variables of Transformer(cfg)'s shapes (eval_shape: no init compile)."""
  shapes = nn.unbox(jax.eval_shape(lambda: Transformer(cfg).init(
      jax.random.key(0), jnp.zeros((1, 4), jnp.int32))))
  rng = np.random.RandomState(seed)
  variables = jax.tree.map(lambda s: rng.randn(*s.shape).astype(s.dtype), shapes)
  return variables["params"], {k: v for k, v in variables.items() if k != "params"}


def assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and np.array_equal(x, y)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_round_trip_is_exact_and_independent_of_scan(name):
  cfg = ModelConfig(**BASE, **CONFIGS[name])
  arch = pick_architecture(cfg)
  params, state = init(cfg)
  tensors = variables_to_hf(params, state, cfg, arch)
  params2, state2 = hf_to_variables(tensors, cfg, arch)
  assert_trees_equal((params, state), (params2, state2))
  check_shapes(params2, state2, cfg)
  flipped = cfg.replace(scan_layers=not cfg.scan_layers)
  p3, s3 = hf_to_variables(tensors, flipped, arch)
  check_shapes(p3, s3, flipped)
  again = variables_to_hf(p3, s3, flipped, arch)
  assert sorted(again) == sorted(tensors)
  for k in tensors:
    assert np.array_equal(again[k], tensors[k]), k


def test_bfloat16_params_round_trip():
  cfg = ModelConfig(**BASE, param_dtype="bfloat16")
  params, state = init(cfg)
  assert jax.tree.leaves(params)[0].dtype == ml_dtypes.bfloat16
  tensors = variables_to_hf(params, state, cfg, "LlamaForCausalLM")
  assert_trees_equal(params, hf_to_variables(tensors, cfg, "LlamaForCausalLM")[0])


def test_missing_extra_and_misshapen_tensors_are_refused():
  cfg = ModelConfig(**BASE)
  tensors = variables_to_hf(*init(cfg), cfg, "LlamaForCausalLM")
  missing = {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"}
  with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
    hf_to_variables(missing, cfg, "LlamaForCausalLM")
  extra = {**tensors, "model.layers.0.self_attn.o_proj.bias": np.zeros(32, np.float32)}
  with pytest.raises(ValueError, match="o_proj.bias"):
    hf_to_variables(extra, cfg, "LlamaForCausalLM")
  bad = {**tensors, "model.layers.2.self_attn.k_proj.weight": np.zeros((8, 32), np.float32)}
  with pytest.raises(ValueError, match="layer 2"):
    hf_to_variables(bad, cfg, "LlamaForCausalLM")
  norm = {**tensors, "model.norm.weight": np.ones(31, np.float32)}
  with pytest.raises(ValueError, match="final_norm"):
    check_shapes(*hf_to_variables(norm, cfg, "LlamaForCausalLM"), cfg)

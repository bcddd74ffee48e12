"""The FLOP formula against hand arithmetic and against the real parameter count."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from model import ModelConfig, Transformer
from model.flops import matmul_params_per_token, training_flops_per_token


def test_flops_by_hand():
  cfg = ModelConfig(vocab_size=100, d_model=8, num_layers=2, num_heads=2, num_kv_heads=1,
                    mlp_dim=16, max_seq_len=16)
  H = 4
  per_layer = 8 * 2 * H + 2 * 8 * 1 * H + 2 * H * 8 + 3 * 8 * 16
  assert matmul_params_per_token(cfg) == 2 * per_layer + 8 * 100
  attn = 12 * 2 * 2 * H * (10 + 1) / 2
  assert training_flops_per_token(cfg, 10) == 6 * (2 * per_layer + 800) + attn
  assert training_flops_per_token(cfg, 10, causal=False) == 6 * (2 * per_layer + 800) + 12 * 2 * 2 * H * 10


def test_dense_matmul_params_equal_real_params_minus_embedding_and_norms():
  cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2,
                    mlp_dim=48, max_seq_len=16)
  shapes = jax.eval_shape(lambda: Transformer(cfg).init(jax.random.key(0),
                                                        jnp.zeros((1, 4), jnp.int32)))
  params = nn.unbox(shapes["params"])
  total = sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params))
  norms = (2 * cfg.num_layers + 1) * cfg.d_model
  assert matmul_params_per_token(cfg) == total - norms - 64 * 32

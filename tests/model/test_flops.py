"""The FLOP formula against hand arithmetic and against the real parameter count."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import ModelConfig, Transformer
from model.flops import matmul_params_per_token, mfu, training_flops_per_token


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


def test_mfu_is_per_device():
  # 8 devices of 1e12 FLOP/s peak; 2e5 tok/s * 1e7 FLOP/token = 2e12 FLOP/s in all.
  assert mfu(2e5, 1e7, 1e12, 8) == pytest.approx(0.25)
  # 8x one device's throughput on 8 devices: the same MFU as that one device.
  assert mfu(8 * 3e4, 1e7, 1e12, 8) == pytest.approx(mfu(3e4, 1e7, 1e12, 1))
  assert mfu(3e4, 1e7, 1e12, 1) == pytest.approx(0.3)


@pytest.mark.parametrize("peak, devices, name", [(0.0, 1, "peak_flops_per_device"),
                                                 (float("nan"), 1, "peak_flops_per_device"),
                                                 (1e12, 0, "num_devices")])
def test_mfu_rejects_bad_inputs(peak, devices, name):
  with pytest.raises(ValueError, match=name):
    mfu(1e3, 1e6, peak, devices)

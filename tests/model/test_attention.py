"""Attention: grouped heads equal explicit references; masks do what they say."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import ModelConfig, Transformer
from model.attention.gqa import attend, make_mask


def reference_attention(q_BLNH, k_BSKH, v_BSKH, mask_BLS, scale):
  """Plain multi-head attention, KV heads repeated to N explicitly."""
  N, K = q_BLNH.shape[2], k_BSKH.shape[2]
  k_BSNH = jnp.repeat(k_BSKH, N // K, axis=2)
  v_BSNH = jnp.repeat(v_BSKH, N // K, axis=2)
  s_BNLS = jnp.einsum("blnh,bsnh->bnls", q_BLNH, k_BSNH) * scale
  s_BNLS = jnp.where(mask_BLS[:, None], s_BNLS, -jnp.inf)
  return jnp.einsum("bnls,bsnh->blnh", jax.nn.softmax(s_BNLS, -1), v_BSNH)


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])  # MHA, GQA, MQA.
def test_grouped_attention_matches_repeated_kv_reference(num_kv_heads):
  B, L, N, H = 2, 7, 4, 8
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q_BLNH = jax.random.normal(kq, (B, L, N, H))
  k_BSKH = jax.random.normal(kk, (B, L, num_kv_heads, H))
  v_BSKH = jax.random.normal(kv, (B, L, num_kv_heads, H))
  seg_BL = jnp.array([[1, 1, 1, 2, 2, 2, 2], [1, 1, 1, 1, 1, 1, 0]])
  mask_BLS = make_mask(jnp.arange(L), jnp.arange(L), seg_BL, seg_BL)
  got = attend(q_BLNH.reshape(B, L, num_kv_heads, N // num_kv_heads, H), k_BSKH, v_BSKH,
               mask_BLS, scale=H ** -0.5).reshape(B, L, N, H)
  want = reference_attention(q_BLNH, k_BSKH, v_BSKH, mask_BLS, H ** -0.5)
  np.testing.assert_allclose(got, want, atol=1e-5)


def test_mask_causal_segments_and_window():
  seg_BL = jnp.array([[1, 1, 2, 2, 2, 0]])
  m = np.asarray(make_mask(jnp.arange(6), jnp.arange(6), seg_BL, seg_BL, sliding_window=2))[0]
  want = np.zeros((6, 6), bool)
  for i in range(6):
    for j in range(6):
      want[i, j] = j <= i and i - j < 2 and seg_BL[0, i] == seg_BL[0, j]
  np.testing.assert_array_equal(m, want)


def test_module_with_mha_equals_reference_from_its_own_params():
  """The full Attention module (K = N) against einsums written out by hand."""
  cfg = ModelConfig(vocab_size=32, d_model=16, num_layers=1, num_heads=4, num_kv_heads=4,
                    mlp_dim=32, max_seq_len=16, pos_encoding="none", scan_layers=False)
  from model.attention.gqa import Attention
  x_BLD = jax.random.normal(jax.random.key(1), (2, 5, 16))
  pos_BL = jnp.broadcast_to(jnp.arange(5), (2, 5))
  seg_BL = jnp.ones((2, 5), jnp.int32)
  attn = Attention(cfg)
  params = attn.init(jax.random.key(0), x_BLD, pos_BL, seg_BL)["params"]
  got = attn.apply({"params": params}, x_BLD, pos_BL, seg_BL)
  w = jax.tree_util.tree_map(lambda p: p.value if hasattr(p, "value") else p, params,
                             is_leaf=lambda p: hasattr(p, "value"))
  q = jnp.einsum("bld,dnh->blnh", x_BLD, w["q"]["w"])
  k = jnp.einsum("bld,dnh->blnh", x_BLD, w["k"]["w"])
  v = jnp.einsum("bld,dnh->blnh", x_BLD, w["v"]["w"])
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((5, 5), bool)), (2, 5, 5))
  o = reference_attention(q, k, v, mask, 4 ** -0.5)
  want = jnp.einsum("blnh,nhd->bld", o, w["o"]["w"])
  np.testing.assert_allclose(got, want, atol=1e-5)


def test_softcap_bounds_logits():
  q = jnp.full((1, 1, 1, 1, 4), 100.0)
  k = jnp.stack([jnp.full((1, 1, 4), 100.0), jnp.zeros((1, 1, 4))], axis=1)
  v = jnp.stack([jnp.ones((1, 1, 4)), jnp.zeros((1, 1, 4))], axis=1)
  mask = jnp.ones((1, 1, 2), bool)
  out = attend(q, k, v, mask, scale=1.0, softcap=2.0)
  # Logits capped at ~2 vs 0: weight on the first value is sigmoid(2), not ~1.
  np.testing.assert_allclose(out[0, 0, 0, 0, 0], jax.nn.sigmoid(2.0), atol=1e-4)


def test_cache_is_sized_by_kv_heads():
  cfg = ModelConfig(vocab_size=32, d_model=32, num_layers=2, num_heads=8, num_kv_heads=2,
                    mlp_dim=32, max_seq_len=64)
  cache = jax.eval_shape(lambda: Transformer(cfg).init(
      jax.random.key(0), jnp.zeros((3, 64), jnp.int32), decode=True))["cache"]
  k = cache["layers"]["attn"]["cached_key"]
  assert k.shape == (2, 3, 64, 2, 4)  # [layers, B, S_max, K, H]

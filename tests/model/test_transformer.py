"""Transformer properties: shapes, causality, packing, relative positions, scan/remat."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import ModelConfig, Transformer

B, L = 2, 12
BASE = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=64,
            max_seq_len=32)
POS = ["rope", "sinusoidal", "learned", "alibi", "none"]


def make(**kw):
  return ModelConfig(**{**BASE, **kw})


@functools.partial(jax.jit, static_argnums=0)
def _apply(cfg, variables, tokens_BL, positions_BL, segment_ids_BL):
  return Transformer(cfg).apply(variables, tokens_BL, positions_BL, segment_ids_BL)


def init_apply(cfg, tokens):
  """Variables and an apply function; one compile per (config, shape), shared by tests."""
  variables = jax.jit(Transformer(cfg).init)(jax.random.key(0), tokens)

  def apply(v, t, positions_BL=None, segment_ids_BL=None):
    B, L = t.shape
    if positions_BL is None:
      positions_BL = jnp.broadcast_to(jnp.arange(L), (B, L))
    if segment_ids_BL is None:
      segment_ids_BL = jnp.ones((B, L), jnp.int32)
    return _apply(cfg, v, t, positions_BL, segment_ids_BL)

  return variables, apply


def tokens(seed=0, shape=(B, L)):
  return jax.random.randint(jax.random.key(seed), shape, 0, BASE["vocab_size"])


VARIANTS = [
    dict(),
    dict(num_kv_heads=4), dict(num_kv_heads=1),
    dict(norm_position="post", norm="layernorm", ffn="relu"),
    dict(ffn="geglu", tie_embeddings=True, qk_norm=True),
    dict(ffn="gelu", sliding_window=4, attn_logit_softcap=30.0, attn_bias=True),
    dict(rope_layout="interleaved", rope_fraction=0.5, rope_scaling="yarn",
         rope_scaling_factor=4.0, rope_original_max_len=8),
    dict(rope_scaling="llama3", rope_scaling_factor=8.0, rope_original_max_len=8),
    dict(rope_scaling="dynamic_ntk", rope_scaling_factor=2.0, rope_original_max_len=8),
    dict(dtype="bfloat16"),
    dict(head_dim=16),
] + [dict(pos_encoding=p) for p in POS[1:]]


@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "default")
def test_shapes_and_dtypes(kw):
  """By abstract evaluation: every variant traces, with the right shapes and dtypes."""
  cfg = make(scan_layers=False, **kw)
  net = Transformer(cfg)
  variables = jax.eval_shape(net.init, jax.random.key(0), tokens())
  logits = jax.eval_shape(net.apply, variables, tokens())
  assert logits.shape == (B, L, cfg.vocab_size) and logits.dtype == jnp.float32
  for p in jax.tree_util.tree_leaves(nn.unbox(variables["params"])):
    assert p.dtype == jnp.float32  # Params stay float32 whatever the compute dtype.


def test_7b_preset_parameter_count_without_allocating():
  cfg = ModelConfig(vocab_size=32000, d_model=4096, num_layers=32, num_heads=32,
                    num_kv_heads=32, mlp_dim=11008, max_seq_len=4096)
  shapes = jax.eval_shape(lambda: Transformer(cfg).init(jax.random.key(0),
                                                        jnp.zeros((1, 8), jnp.int32)))
  n = sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(nn.unbox(shapes["params"])))
  assert n == 6_738_415_616  # Llama-2-7B.


@pytest.mark.parametrize("pos", POS + ["window"])
def test_causality(pos):
  kw = dict(sliding_window=3) if pos == "window" else dict(pos_encoding=pos)
  cfg = make(**kw)
  t = tokens()
  variables, apply = init_apply(cfg, t)
  base = apply(variables, t)
  changed = apply(variables, t.at[:, 6].set((t[:, 6] + 1) % BASE["vocab_size"]))
  np.testing.assert_array_equal(base[:, :6], changed[:, :6])
  assert not np.allclose(base[:, 6:], changed[:, 6:])


@pytest.mark.parametrize("pos", ["rope", "alibi", "learned"])
def test_packed_documents_equal_separate_runs(pos):
  """Row 0 packs documents a and b; row 1 holds one of them alone (then padding)."""
  cfg = make(pos_encoding=pos)
  t = tokens(1)
  a, b = t[0, :5], t[1, :7]
  packed = jnp.concatenate([a, b])
  pad = lambda x: jnp.concatenate([x, jnp.zeros(L - len(x), x.dtype)])
  positions = jnp.stack([jnp.concatenate([jnp.arange(5), jnp.arange(7)]), jnp.arange(L)])
  variables, apply = init_apply(cfg, t)
  for doc, sl in ((a, slice(0, 5)), (b, slice(5, 12))):
    n = len(doc)
    seg = jnp.stack([jnp.array([1] * 5 + [2] * 7), (jnp.arange(L) < n).astype(jnp.int32)])
    out = apply(variables, jnp.stack([packed, pad(doc)]), positions, seg)
    np.testing.assert_allclose(out[0, sl], out[1, :n], atol=1e-5)


@pytest.mark.parametrize("pos,invariant", [("rope", True), ("alibi", True), ("none", True),
                                           ("learned", False), ("sinusoidal", False)])
def test_relative_position_invariance(pos, invariant):
  cfg = make(pos_encoding=pos)
  t = tokens()
  variables, apply = init_apply(cfg, t)
  positions = jnp.broadcast_to(jnp.arange(L), (B, L))
  base = apply(variables, t, positions_BL=positions)
  shifted = apply(variables, t, positions_BL=positions + 9)
  assert np.allclose(base, shifted, atol=1e-4) == invariant


def unstack(params, n):
  """Scanned params ({'layers': stacked}) -> unscanned ({'layer_i': ...})."""
  out = {k: v for k, v in params.items() if k != "layers"}
  for i in range(n):
    out[f"layer_{i}"] = jax.tree_util.tree_map(lambda x: x[i], params["layers"])
  return out


@functools.partial(jax.jit, static_argnums=1)
def _value_and_grad(params, cfg, t):
  loss = lambda p: jnp.mean(Transformer(cfg).apply({"params": p}, t) ** 2)
  return jax.value_and_grad(loss)(params)


@pytest.mark.parametrize("remat,unroll", [("none", 1), ("full", 1), ("save_dots", 1),
                                          ("none", 64), ("full", 2)])
def test_scan_and_remat_match_unscanned(remat, unroll):
  """Any remat policy and any `scan_unroll` (2: two layers per iteration; 64: no loop)
  computes what the unscanned stack does, from the same stacked parameters."""
  t = tokens()
  scanned = make(scan_layers=True, remat=remat, dropout_rate=0.0, scan_unroll=unroll)
  plain = make(scan_layers=False)
  params = nn.unbox(Transformer(scanned).init(jax.random.key(0), t)["params"])

  l_scan, g_scan = _value_and_grad(params, scanned, t)
  l_plain, g_plain = _value_and_grad(unstack(params, scanned.num_layers), plain, t)
  np.testing.assert_allclose(l_scan, l_plain, rtol=1e-6)
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6),
                         unstack(g_scan, scanned.num_layers), g_plain)


def test_bfloat16_compute_close_to_float32():
  t = tokens()
  variables, apply32 = init_apply(make(), t)
  _, apply16 = init_apply(make(dtype="bfloat16"), t)
  np.testing.assert_allclose(apply16(variables, t), apply32(variables, t), atol=0.1)


def test_dropout_is_active_only_when_not_deterministic():
  cfg = make(dropout_rate=0.5, embed_dropout_rate=0.5)
  t = tokens()
  net = Transformer(cfg)
  v = jax.jit(net.init)(jax.random.key(0), t)
  train = jax.jit(lambda k: net.apply(v, t, deterministic=False, rngs={"dropout": k}))
  assert not np.allclose(train(jax.random.key(1)), train(jax.random.key(2)))
  np.testing.assert_array_equal(train(jax.random.key(1)), train(jax.random.key(1)))


@pytest.mark.parametrize("field,value", [("num_kv_heads", 3), ("pos_encoding", "xpos"),
                                         ("rope_fraction", 0.0), ("ffn", "swish"),
                                         ("d_model", 0), ("max_seq_len", 0),
                                         ("attention_block_q", -1)])
def test_invalid_config_names_field(field, value):
  with pytest.raises(ValueError, match=field):
    make(**{field: value})

"""Blockwise's block bounds, blocks and memory; the Transformer on blockwise equals it on the
reference; "auto" and errors say what they do. Each implementation against the reference, op
by op: tests/model/attention/test_impl_table.py.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import ModelConfig, Transformer
from model.attention.impls import resolve_attention_impl
from model.attention.reference import AttnData, AttnSpec, xla_attention
from model.attention.blockwise import _kv_blocks, _q_blocks, auto_block, blockwise_attention
from tests.model.attention.test_impl_table import B, H, L, POS_BL, SEG_BL, assert_trees_close

@pytest.mark.parametrize("window", [0, 5, 17])
def test_block_bounds_visit_exactly_the_blocks_the_mask_reaches(window):
  """Skipped block pairs are wholly masked; visited ones hold a visible (q, k) pair."""
  bq, bk, Lp, Sp = 16, 8, 48, 40
  spec = AttnSpec(scale=1.0, sliding_window=window, block_q=bq, block_kv=bk)
  q_LS, k_LS = np.meshgrid(np.arange(Lp), np.arange(Sp), indexing="ij")
  visible_LS = (k_LS <= q_LS) & ((q_LS - k_LS < window) if window else True)
  reach = visible_LS.reshape(Lp // bq, bq, Sp // bk, bk).any(axis=(1, 3))
  by_q = np.zeros_like(reach)
  for i in range(Lp // bq):
    lo, hi = (int(x) for x in _kv_blocks(spec, i, Sp // bk))
    by_q[i, lo:hi] = True
  by_kv = np.zeros_like(reach)
  for j in range(Sp // bk):
    lo, hi = (int(x) for x in _q_blocks(spec, j, Lp // bq))
    by_kv[lo:hi, j] = True
  np.testing.assert_array_equal(by_q, reach)
  np.testing.assert_array_equal(by_kv, reach)
  assert reach.sum() < reach.size  # Something is skipped.


TRANSFORMER = dict(vocab_size=64, d_model=32, num_layers=1, num_heads=4, mlp_dim=64,
                   max_seq_len=64, attention_block_q=16, attention_block_kv=8)


@pytest.mark.parametrize("opts", [
    dict(num_kv_heads=2, pos_encoding="rope"),  # Scanned: the custom_vjp inside nn.scan.
    dict(num_kv_heads=1, pos_encoding="alibi", sliding_window=6, attn_logit_softcap=3.0,
         scan_layers=False),
], ids=["gqa_rope_scanned", "mqa_alibi_window_softcap"])
def test_transformer_blockwise_equals_reference_logits_and_param_gradients(opts):
  cfg = ModelConfig(**TRANSFORMER, **opts, attention_impl="xla")
  tokens_BL = jax.random.randint(jax.random.key(1), (B, L), 0, 64)
  w_BLV = jax.random.normal(jax.random.key(2), (B, L, 64))
  variables = jax.jit(Transformer(cfg).init)(jax.random.key(0), tokens_BL)

  def logits_and_grads(c):
    def loss(params):
      logits_BLV = Transformer(c).apply({**variables, "params": params}, tokens_BL,
                                        jnp.asarray(POS_BL), jnp.asarray(SEG_BL))
      return jnp.sum(logits_BLV * w_BLV), logits_BLV
    return jax.jit(jax.grad(loss, has_aux=True))(variables["params"])

  want = logits_and_grads(cfg)
  got = logits_and_grads(cfg.replace(attention_impl="blockwise"))
  assert_trees_close(got, want, "Transformer blockwise vs xla: param grads, logits")


@pytest.mark.parametrize("rows, block", [
    (4, 256),  # Batch 1, 4 heads: a 1 MiB tile.
    (16, 256),  # Batch 4, 4 heads: 4 MiB, the largest kept.
    (64, 128),  # The M benchmark (batch 8, 2 KV heads x 4): 16 MiB at 256 -> 4 MiB.
    (256, 64), (4096, 64),  # Never below 64: loop overhead would dominate.
])
def test_auto_block_keeps_the_score_tile_in_budget(rows, block):
  assert auto_block(rows) == block


def test_auto_blocks_equal_explicit_blocks_of_the_same_size():
  """Blocks 0 run exactly what the explicit blocks of auto_block's choice run."""
  Lb, K, G = 160, 64, 4  # 256 rows: 64-blocks, three of them (the last one padded).
  ks = jax.random.split(jax.random.key(3), 3)
  q = jax.random.normal(ks[0], (1, Lb, K, G, 4))
  k, v = (jax.random.normal(key, (1, Lb, K, 4)) for key in ks[1:])
  seg, pos = jnp.ones((1, Lb), jnp.int32), jnp.arange(Lb, dtype=jnp.int32)[None]
  data = AttnData(seg, seg, pos, pos)
  auto = AttnSpec(scale=0.5)

  def grads(spec):
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(
        blockwise_attention(q, k, v, data, spec) ** 2), argnums=(0, 1, 2)))(q, k, v)

  want = grads(dataclasses.replace(auto, block_q=64, block_kv=64))
  jax.tree.map(np.testing.assert_array_equal, grads(auto), want)
  other = grads(dataclasses.replace(auto, block_q=32, block_kv=32))  # Another order of sums.
  assert any(bool(jnp.any(a != b)) for a, b in zip(other, want))


def test_blockwise_backward_memory_is_linear_not_quadratic():
  """At L = 1024 the gradient's temporaries stay far below the reference's [L, S] scores."""
  Lm, K, G = 1024, 2, 2
  spec = AttnSpec(scale=H ** -0.5, block_q=128, block_kv=128)
  data = AttnData(*[jnp.ones((1, Lm), jnp.int32)] * 2, *[jnp.zeros((1, Lm), jnp.int32)] * 2)
  shapes = [jax.ShapeDtypeStruct(s, jnp.float32) for s in
            ((1, Lm, K, G, H), (1, Lm, K, H), (1, Lm, K, H))]

  def temp_bytes(fn):
    grad = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, data, spec)), argnums=(0, 1, 2))
    return jax.jit(grad).lower(*shapes).compile().memory_analysis().temp_size_in_bytes

  scores_bytes = K * G * Lm * Lm * 4  # One float32 [B, K, G, L, S] array: 16 MiB.
  xla, blockwise = temp_bytes(xla_attention), temp_bytes(blockwise_attention)
  assert xla >= scores_bytes, xla
  assert blockwise < scores_bytes / 8, (blockwise, xla)


def test_auto_resolves_by_backend_length_and_config():
  cfg = ModelConfig(**{**TRANSFORMER, "num_kv_heads": 2})
  bf16 = cfg.replace(dtype="bfloat16")
  assert resolve_attention_impl(cfg, "cpu", 256) == "xla"
  assert resolve_attention_impl(cfg, "cpu", 4096) == "blockwise"
  assert resolve_attention_impl(cfg, "tpu", 256) == "splash"
  assert resolve_attention_impl(cfg, "tpu", 4096) == "splash"  # shard_mapped under a mesh.
  assert resolve_attention_impl(cfg.replace(pos_encoding="alibi"), "tpu", 256) == "xla"
  assert resolve_attention_impl(bf16, "gpu", 256) == "cudnn"
  assert resolve_attention_impl(cfg, "gpu", 4096) == "blockwise"  # cuDNN needs bfloat16.
  assert resolve_attention_impl(bf16.replace(attn_logit_softcap=5.0), "gpu", 256) == "xla"
  assert resolve_attention_impl(cfg.replace(attention_impl="xla"), "cpu", 10**6) == "xla"


def test_kernels_name_what_they_lack():
  base = dict(**TRANSFORMER, num_kv_heads=2)
  with pytest.raises(ValueError, match="attention_impl.*attn_logit_softcap.*soft-cap"):
    ModelConfig(**base, attention_impl="cudnn", dtype="bfloat16", attn_logit_softcap=5.0)
  with pytest.raises(ValueError, match="attention_impl.*dtype='float32'.*bfloat16"):
    ModelConfig(**base, attention_impl="cudnn")
  with pytest.raises(ValueError, match="attention_impl.*alibi.*no additive bias"):
    ModelConfig(**base, attention_impl="splash", pos_encoding="alibi")
  with pytest.raises(ValueError, match="attention_impl.*must be one of"):
    ModelConfig(**base, attention_impl="flash")
  tokens_BL = jnp.zeros((1, 8), jnp.int32)
  for impl, cfg_kw, device in (("cudnn", dict(dtype="bfloat16"), "GPU"), ("splash", {}, "TPU")):
    cfg = ModelConfig(**base, attention_impl=impl, **cfg_kw)
    # Init (and so restoring a run) works on any host; running the kernel does not.
    variables = jax.eval_shape(Transformer(cfg).init, jax.random.key(0), tokens_BL)
    msg = f"attention_impl='{impl}' needs a {device}; this backend is cpu"
    with pytest.raises(ValueError, match=msg):
      jax.eval_shape(Transformer(cfg).apply, variables, tokens_BL)


def test_spec_reads_every_attention_field_of_the_config():
  cfg = ModelConfig(**TRANSFORMER, num_kv_heads=2, pos_encoding="alibi", attn_scale=0.5,
                    sliding_window=3, attn_logit_softcap=4.0)
  from model.attention.reference import spec_from_config  # pylint: disable=g-import-not-at-top
  assert dataclasses.asdict(spec_from_config(cfg)) == dict(
      scale=0.5, softcap=4.0, sliding_window=3, alibi=True, block_q=16, block_kv=8)

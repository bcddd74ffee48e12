"""Positional encodings: published formulas by hand, HF parity, RoPE invariances, ALiBi."""

import math

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.config import ModelConfig
from model.transformer import Transformer
from model.attention.scores import alibi_bias, alibi_slopes
from model.positional import (LearnedPositionalEmbedding, apply_rope, rope_inv_freq, rotary_dim,
                              sinusoidal_embedding)

THETA, ORIG, FACTOR = 10_000.0, 4096, 4.0
SCALINGS = ("none", "linear", "ntk", "dynamic_ntk", "yarn", "llama3")
# One compile per (shape, config) instead of one per eager op: keeps the file fast.
rope = jax.jit(apply_rope, static_argnums=(2,))


def normal(seed, shape):  # NumPy data: no compile per shape for the random draws.
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def make_cfg(rope_fraction=1.0, **kw):
  base = dict(vocab_size=32, d_model=128, num_layers=1, num_heads=4, num_kv_heads=2,
              mlp_dim=64, max_seq_len=4 * ORIG, rope_original_max_len=ORIG,
              rope_theta=THETA, rope_fraction=rope_fraction)
  base.update(kw)
  return ModelConfig(**base)


def scaled_cfg(scaling, rope_fraction=1.0, **kw):
  factor = 1.0 if scaling == "none" else FACTOR
  return make_cfg(rope_fraction, rope_scaling=scaling, rope_scaling_factor=factor, **kw)


# Hand-written published formulas (plain Python, one frequency at a time). --------

def hand_inv_freq(scaling, dim, seq_len=None):
  default = [THETA ** (-(2 * i) / dim) for i in range(dim // 2)]
  if scaling == "none":
    return default, 1.0
  if scaling == "linear":  # Chen et al. 2023: positions / s.
    return [f / FACTOR for f in default], 1.0
  if scaling == "ntk":  # NTK-aware: b' = b * s^(d / (d - 2)).
    b = THETA * FACTOR ** (dim / (dim - 2))
    return [b ** (-(2 * i) / dim) for i in range(dim // 2)], 1.0
  if scaling == "dynamic_ntk":
    if seq_len is None or seq_len <= ORIG:
      return default, 1.0
    b = THETA * (FACTOR * seq_len / ORIG - (FACTOR - 1)) ** (dim / (dim - 2))
    return [b ** (-(2 * i) / dim) for i in range(dim // 2)], 1.0
  if scaling == "yarn":  # Peng et al. 2023, beta_fast=32, beta_slow=1, truncated range.
    def r_dim(rotations):
      return dim * math.log(ORIG / (rotations * 2 * math.pi)) / (2 * math.log(THETA))
    lo, hi = max(math.floor(r_dim(32)), 0), min(math.ceil(r_dim(1)), dim - 1)
    out = []
    for i, f in enumerate(default):
      gamma = 1.0 - min(max((i - lo) / (hi - lo), 0.0), 1.0)  # 1: extrapolate (keep f).
      out.append(gamma * f + (1 - gamma) * f / FACTOR)
    return out, 0.1 * math.log(FACTOR) + 1
  if scaling == "llama3":  # low_freq_factor=1, high_freq_factor=4.
    out = []
    for f in default:
      wavelen = 2 * math.pi / f
      if wavelen < ORIG / 4:
        out.append(f)
      elif wavelen > ORIG / 1:
        out.append(f / FACTOR)
      else:
        smooth = (ORIG / wavelen - 1) / (4 - 1)
        out.append((1 - smooth) * f / FACTOR + smooth * f)
    return out, 1.0
  raise AssertionError(scaling)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("scaling", SCALINGS)
def test_inv_freq_matches_hand_formula(scaling, fraction):
  cfg = scaled_cfg(scaling, fraction)
  dim = rotary_dim(cfg)
  seq_len = 3 * ORIG if scaling == "dynamic_ntk" else None
  inv_F, attn = rope_inv_freq(cfg, seq_len)
  want_F, want_attn = hand_inv_freq(scaling, dim, seq_len)
  assert inv_F.dtype == jnp.float32 and inv_F.shape == (dim // 2,)
  np.testing.assert_allclose(inv_F, want_F, rtol=1e-6)
  np.testing.assert_allclose(float(attn), want_attn, rtol=1e-7)
  if scaling in ("yarn", "llama3"):  # The config really blends: neither all kept nor all scaled.
    default_F, _ = hand_inv_freq("none", dim)
    kept = np.isclose(want_F, default_F, rtol=1e-9)
    assert kept.any() and not kept.all()


class _HFConfig:
  """The few attributes transformers' rope init functions read."""

  def __init__(self, head_dim, max_position_embeddings, **rope_parameters):
    self.head_dim, self.hidden_size, self.num_attention_heads = head_dim, 4 * head_dim, 4
    self.max_position_embeddings = max_position_embeddings
    self.rope_parameters = dict(rope_theta=THETA, **rope_parameters)

  def standardize_rope_params(self):
    pass


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("scaling", SCALINGS)
def test_inv_freq_matches_transformers(scaling, fraction):
  pytest.importorskip("torch")
  rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
  fns = rope_utils.ROPE_INIT_FUNCTIONS
  cfg = scaled_cfg(scaling, fraction)
  hd = cfg.resolved_head_dim
  common = dict(partial_rotary_factor=fraction)
  if scaling == "none":  # HF has no "default" entry; linear with factor 1 is the default.
    hf = fns["linear"](_HFConfig(hd, ORIG, factor=1.0, **common))
  elif scaling == "linear":
    hf = fns["linear"](_HFConfig(hd, ORIG, factor=FACTOR, **common))
  elif scaling == "ntk":  # HF has only dynamic; at seq_len = 2 * orig, factor f' = s - 1
    # its base term f' * 2 - (f' - 1) equals s: static NTK with factor s.
    hf = fns["dynamic"](_HFConfig(hd, ORIG, factor=FACTOR - 1, **common), seq_len=2 * ORIG)
  elif scaling == "dynamic_ntk":
    hf = fns["dynamic"](_HFConfig(hd, ORIG, factor=FACTOR, **common), seq_len=3 * ORIG)
  elif scaling == "yarn":
    hf = fns["yarn"](_HFConfig(hd, 4 * ORIG, factor=FACTOR, beta_fast=32.0, beta_slow=1.0,
                               original_max_position_embeddings=ORIG, **common))
  else:
    hf = fns["llama3"](_HFConfig(hd, 4 * ORIG, factor=FACTOR, low_freq_factor=1.0,
                                 high_freq_factor=4.0, original_max_position_embeddings=ORIG,
                                 **common))
  inv_F, attn = rope_inv_freq(cfg, 3 * ORIG if scaling == "dynamic_ntk" else None)
  np.testing.assert_allclose(inv_F, hf[0].numpy(), rtol=2e-6)
  np.testing.assert_allclose(float(attn), hf[1], rtol=1e-7)


def test_dynamic_ntk_traced_and_unscaled_within_original_length():
  cfg = scaled_cfg("dynamic_ntk")
  unscaled_F, _ = rope_inv_freq(cfg.replace(rope_scaling="none", rope_scaling_factor=1.0))
  for short in (None, 7, ORIG):
    np.testing.assert_array_equal(rope_inv_freq(cfg, short)[0], unscaled_F)
  traced = jax.jit(lambda s: rope_inv_freq(cfg, s)[0])
  np.testing.assert_array_equal(traced(jnp.int32(ORIG - 1)), unscaled_F)
  np.testing.assert_allclose(traced(jnp.int32(3 * ORIG)), rope_inv_freq(cfg, 3 * ORIG)[0],
                             rtol=1e-6)
  # apply_rope's default seq_len is max(position) + 1, as HF's forward.
  x = normal(0, (1, 3, 1, cfg.resolved_head_dim))
  pos = jnp.array([[0, 5000, 9000]])
  np.testing.assert_allclose(rope(x, pos, cfg), rope(x, pos, cfg, seq_len=jnp.int32(9001)),
                             rtol=1e-6, atol=1e-6)


# RoPE application. ---------------------------------------------------------------

def numpy_reference(x, pos, cfg):
  """HF NeoX/Llama (rotate_half) and GPT-J (rotate_every_two) written out in numpy."""
  inv_F, attn = rope_inv_freq(cfg)
  x, R = np.asarray(x, np.float64), rotary_dim(cfg)
  freqs = np.asarray(pos, np.float64)[:, :, None, None] * np.asarray(inv_F, np.float64)
  x_rot, x_pass = x[..., :R], x[..., R:]
  if cfg.rope_layout == "split_half":
    emb = np.concatenate([freqs, freqs], -1)
    half = np.concatenate([-x_rot[..., R // 2:], x_rot[..., :R // 2]], -1)
  else:
    emb = np.repeat(freqs, 2, axis=-1)
    half = np.stack([-x_rot[..., 1::2], x_rot[..., ::2]], -1).reshape(x_rot.shape)
  out = x_rot * np.cos(emb) * attn + half * np.sin(emb) * attn
  return np.concatenate([out, x_pass], -1)


@pytest.mark.parametrize("layout", ["split_half", "interleaved"])
@pytest.mark.parametrize("fraction,scaling", [(1.0, "none"), (0.5, "yarn"), (0.25, "llama3")])
def test_apply_rope_matches_reference(layout, fraction, scaling):
  cfg = scaled_cfg(scaling, fraction, rope_layout=layout)
  x = normal(1, (2, 5, 4, cfg.resolved_head_dim))
  pos = np.random.default_rng(2).integers(0, 3000, (2, 5), dtype=np.int32)
  np.testing.assert_allclose(rope(x, pos, cfg), numpy_reference(x, pos, cfg),
                             rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", ["split_half", "interleaved"])
def test_rotation_by_hand(layout):
  cfg = make_cfg(d_model=2, num_heads=1, num_kv_heads=1, rope_layout=layout)  # H = 2, inv_freq = 1.
  x = jnp.array([[[[1.0, 0.0]], [[0.0, 1.0]]]])  # [B=1, L=2, N=1, H=2]
  out = rope(x, jnp.array([[1, 2]]), cfg)
  np.testing.assert_allclose(out[0, :, 0], [[math.cos(1), math.sin(1)],
                                            [-math.sin(2), math.cos(2)]], rtol=1e-6)


@pytest.mark.parametrize("layout", ["split_half", "interleaved"])
@pytest.mark.parametrize("fraction,scaling", [(1.0, "none"), (0.5, "none"), (0.5, "yarn"),
                                              (1.0, "llama3"), (0.5, "linear")])
def test_scores_depend_only_on_relative_position(layout, fraction, scaling):
  cfg = scaled_cfg(scaling, fraction, rope_layout=layout)
  q, k = normal(3, (2, 2, 6, 2, cfg.resolved_head_dim))
  pos = np.random.default_rng(3).integers(0, 64, (2, 6), dtype=np.int32)

  def scores(p):
    return np.einsum("BLNH,BSNH->BNLS", rope(q, p, cfg), rope(k, p, cfg))

  ref = scores(pos)
  for shift in (1, 37, 1000):
    np.testing.assert_allclose(scores(pos + shift), ref, atol=2e-3, rtol=1e-4)
  assert not np.allclose(scores(2 * pos), ref, atol=1e-2)  # Positions do matter.


def test_layouts_are_one_rotation_up_to_a_permutation():
  split = make_cfg(0.5, rope_layout="split_half")
  inter = split.replace(rope_layout="interleaved")
  H, R = split.resolved_head_dim, rotary_dim(split)
  # Interleaved pair (2i, 2i+1) is split-half pair (i, i + R/2); pass-through dims stay.
  perm = np.concatenate([np.arange(0, R, 2), np.arange(1, R, 2), np.arange(R, H)])
  x = normal(4, (1, 4, 2, H))
  pos = jnp.array([[0, 3, 17, 400]])
  np.testing.assert_allclose(rope(x[..., perm], pos, split),
                             rope(x, pos, inter)[..., perm], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", ["split_half", "interleaved"])
def test_partial_rope_passthrough_and_identity_at_zero(layout):
  cfg = make_cfg(0.25, rope_layout=layout)
  R = rotary_dim(cfg)
  x = normal(5, (2, 3, 4, cfg.resolved_head_dim))
  pos = jnp.array([[5, 9, 100], [0, 1, 2]])
  out = rope(x, pos, cfg)
  np.testing.assert_array_equal(out[..., R:], x[..., R:])
  assert not np.allclose(out[0, :, :, :R], x[0, :, :, :R])
  np.testing.assert_allclose(rope(x, np.zeros((2, 3), np.int32), cfg), x, rtol=0, atol=1e-7)
  # YaRN's attention factor scales cos and sin, hence only the rotated dims at position 0.
  yarn = scaled_cfg("yarn", 0.25, rope_layout=layout)
  mscale = 0.1 * math.log(FACTOR) + 1
  out0 = rope(x, np.zeros((2, 3), np.int32), yarn)
  np.testing.assert_allclose(out0[..., :R], mscale * x[..., :R], rtol=1e-6)
  np.testing.assert_array_equal(out0[..., R:], x[..., R:])


def test_rank5_dtype_and_batch_broadcast():
  cfg = make_cfg(0.5)
  x_BLNH = jnp.asarray(normal(6, (2, 3, 4, 32)), jnp.bfloat16)
  pos = jnp.array([[1, 2, 3], [7, 8, 9]])
  out_BLNH = rope(x_BLNH, pos, cfg)
  assert out_BLNH.dtype == jnp.bfloat16
  out_BLKGH = rope(x_BLNH.reshape(2, 3, 2, 2, 32), pos, cfg)
  np.testing.assert_array_equal(out_BLKGH.reshape(out_BLNH.shape), out_BLNH)
  shared = rope(x_BLNH, pos[:1], cfg)  # [1, L] positions broadcast over the batch.
  np.testing.assert_array_equal(shared, rope(x_BLNH, jnp.tile(pos[:1], (2, 1)), cfg))


def test_bad_inputs_name_the_problem():
  cfg = make_cfg()
  x = jnp.zeros((1, 3, 2, 32))
  with pytest.raises(ValueError, match="positions shape"):
    rope(x, jnp.zeros((1, 4), jnp.int32), cfg)
  with pytest.raises(ValueError, match="head dim"):
    rope(jnp.zeros((1, 3, 2, 16)), jnp.zeros((1, 3), jnp.int32), cfg)
  with pytest.raises(ValueError, match="yarn_beta_slow"):
    rope_inv_freq(scaled_cfg("yarn", yarn_beta_slow=0.0))
  with pytest.raises(ValueError, match="llama3_high_freq_factor"):
    rope_inv_freq(scaled_cfg("llama3", llama3_high_freq_factor=1.0))
  with pytest.raises(ValueError, match="rope_fraction"):
    rope_inv_freq(scaled_cfg("ntk", rope_fraction=2 / 32))
  with pytest.raises(ValueError, match="num_heads"):
    alibi_slopes(0)
  with pytest.raises(ValueError, match="d_model"):
    sinusoidal_embedding(jnp.zeros((1, 2), jnp.int32), 7)


# ALiBi, sinusoidal, learned. -------------------------------------------------------

def test_alibi_slopes_follow_the_paper():
  np.testing.assert_array_equal(alibi_slopes(8), [2.0 ** -i for i in range(1, 9)])
  # Not a power of two: the 4-head slopes, then every other 8-head slope.
  four = [1 / 4, 1 / 16, 1 / 64, 1 / 256]
  eight_every_other = [1 / 2, 1 / 8]
  np.testing.assert_array_equal(alibi_slopes(6), four + eight_every_other)
  assert alibi_slopes(6).dtype == np.float32
  np.testing.assert_allclose(alibi_slopes(16)[:2], [2 ** -0.5, 2 ** -1.0], rtol=1e-7)


def test_alibi_bias_values_diagonal_and_shift_invariance():
  q_pos = jnp.array([[0, 1, 2, 3]])
  bias_BNLS = alibi_bias(q_pos, q_pos, 8)
  chex.assert_shape(bias_BNLS, (1, 8, 4, 4))
  assert bias_BNLS.dtype == jnp.float32
  np.testing.assert_array_equal(jnp.diagonal(bias_BNLS, axis1=2, axis2=3), 0.0)
  assert float(bias_BNLS[0, 0, 3, 0]) == -0.5 * 3  # -slope_0 * (3 - 0).
  assert float(bias_BNLS[0, 2, 3, 1]) == -(1 / 8) * 2
  kv_pos = jnp.array([[0, 1, 2, 3, 4, 5]])
  np.testing.assert_array_equal(alibi_bias(q_pos + 100_000, kv_pos + 100_000, 6),
                                alibi_bias(q_pos, kv_pos, 6))


def test_sinusoidal_by_hand():
  pe_BLD = sinusoidal_embedding(jnp.array([[0, 3]]), 8)
  chex.assert_shape(pe_BLD, (1, 2, 8))
  np.testing.assert_allclose(pe_BLD[0, 0], [0, 0, 0, 0, 1, 1, 1, 1], atol=1e-7)
  w1 = 3 / 10_000 ** (2 / 8)  # Pair i = 1: pos / 10000^(2i / D).
  np.testing.assert_allclose(pe_BLD[0, 1, [0, 1, 4, 5]],
                             [math.sin(3), math.sin(w1), math.cos(3), math.cos(w1)], rtol=1e-6)


def test_learned_embedding_returns_rows_of_its_table():
  module = LearnedPositionalEmbedding(max_seq_len=16, d_model=8, init_std=0.02)
  pos = jnp.array([[0, 5, 15], [3, 3, 1]])
  variables = jax.jit(module.init)(jax.random.key(7), pos)
  boxed = variables["params"]["embedding"]
  assert isinstance(boxed, nn.LogicallyPartitioned) and boxed.names == (None, "embed")
  table = nn.unbox(variables)["params"]["embedding"]
  chex.assert_shape(table, (16, 8))
  assert 0.01 < float(jnp.std(table)) < 0.03
  np.testing.assert_array_equal(jax.jit(module.apply)(variables, pos), np.asarray(table)[pos])


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("encoding", ["learned", "sinusoidal"])
def test_additive_positions_start_on_the_token_embeddings_scale(tied, encoding):
  """The position signal the model adds is as large as the token rows it is added to
  (mean row norms within 2x), for tied (1/sqrt(D)) and untied (unit) token tables: a
  learned table at 0.02 under a unit-variance token table was ~3% of the input, and
  the "learned" point of the ablation trained like NoPE."""
  cfg = ModelConfig(vocab_size=256, d_model=64, num_layers=1, num_heads=4, num_kv_heads=4,
                    mlp_dim=128, max_seq_len=64, pos_encoding=encoding, tie_embeddings=tied)
  tokens_BL = jnp.zeros((1, 64), jnp.int32)
  variables = jax.jit(Transformer(cfg).init)(jax.random.key(0), tokens_BL)
  _, inter = Transformer(cfg).apply(variables, tokens_BL, mutable=["intermediates"])
  embedded_LD = inter["intermediates"]["embedded_BLD"][0][0]
  token_row_D = nn.unbox(variables)["params"]["embedder"]["embedding"][0]
  position_norm = float(jnp.linalg.norm(embedded_LD - token_row_D[None], axis=-1).mean())
  token_norm = float(jnp.linalg.norm(
      nn.unbox(variables)["params"]["embedder"]["embedding"], axis=-1).mean())
  assert 0.5 < position_norm / token_norm < 2.0, (position_norm, token_norm)

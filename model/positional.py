"""Every positional encoding: the RoPE family, sinusoidal, learned and ALiBi.

RoPE frequencies follow the published formulas with the numerics of Hugging
Face transformers' `modeling_rope_utils.py` (the reference for logit parity).
Static scalings are computed once in float64 NumPy and rounded to float32 (the
config is static, so they are constants under jit); only `dynamic_ntk` depends
on a (possibly traced) sequence length and is computed with jnp.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from model.config import ROPE_SCALINGS, ModelConfig

# RoPE ----------------------------------------------------------------------


def rotary_dim(cfg: ModelConfig) -> int:
  """Rotated dims per head: int(head_dim * rope_fraction), even (validated)."""
  return int(cfg.resolved_head_dim * cfg.rope_fraction)


def _unscaled(theta: float, dim: int) -> np.ndarray:
  return 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)


def _need_ntk_dim(dim: int) -> None:
  # The NTK exponent dim / (dim - 2) is undefined for a single rotated pair.
  if dim <= 2:
    raise ValueError(f"ModelConfig.rope_fraction: NTK scaling needs rotary_dim > 2, got {dim}")


def _none(cfg: ModelConfig, seq_len) -> tuple[np.ndarray, float]:
  return _unscaled(cfg.rope_theta, rotary_dim(cfg)), 1.0


def _linear(cfg: ModelConfig, seq_len) -> tuple[np.ndarray, float]:
  # Position interpolation: scaling positions by 1/factor == scaling frequencies.
  return _unscaled(cfg.rope_theta, rotary_dim(cfg)) / cfg.rope_scaling_factor, 1.0


def _ntk(cfg: ModelConfig, seq_len) -> tuple[np.ndarray, float]:
  dim = rotary_dim(cfg)
  _need_ntk_dim(dim)
  base = cfg.rope_theta * cfg.rope_scaling_factor ** (dim / (dim - 2))
  return _unscaled(base, dim), 1.0


def _dynamic_ntk(cfg: ModelConfig, seq_len) -> tuple[jax.Array | np.ndarray, float]:
  dim = rotary_dim(cfg)
  _need_ntk_dim(dim)
  inv_f = _unscaled(cfg.rope_theta, dim)
  if seq_len is None:  # As HF at init: seq_len defaults to the original length.
    return inv_f, 1.0
  factor, orig = cfg.rope_scaling_factor, cfg.rope_original_len
  seq = jnp.maximum(jnp.asarray(seq_len, jnp.float32), float(orig))
  ratio = factor * seq / orig - (factor - 1.0)  # == 1 (no scaling) while seq <= orig.
  # base' = theta * ratio**(dim/(dim-2)) gives base'**(-2i/dim) = theta**(-2i/dim) *
  # ratio**(-2i/(dim-2)): the traced part is one power, exactly 1 when unscaled.
  expo_f = -np.arange(0, dim, 2, dtype=np.float64) / (dim - 2)
  return jnp.asarray(inv_f, jnp.float32) * ratio ** jnp.asarray(expo_f, jnp.float32), 1.0


def _yarn(cfg: ModelConfig, seq_len) -> tuple[np.ndarray, float]:
  dim, theta, factor = rotary_dim(cfg), cfg.rope_theta, cfg.rope_scaling_factor
  orig = cfg.rope_original_len
  if not 0 < cfg.yarn_beta_slow < cfg.yarn_beta_fast:
    raise ValueError(f"ModelConfig.yarn_beta_slow={cfg.yarn_beta_slow!r}: need "
                     f"0 < yarn_beta_slow < yarn_beta_fast={cfg.yarn_beta_fast!r}")

  def correction_dim(num_rotations: float) -> float:
    # The dim index whose wavelength fits `num_rotations` times in `orig` tokens.
    return dim * math.log(orig / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

  # HF's default truncate=True: floor/ceil the correction range, then clamp.
  low = max(math.floor(correction_dim(cfg.yarn_beta_fast)), 0)
  high = min(math.ceil(correction_dim(cfg.yarn_beta_slow)), dim - 1)
  if low == high:
    high += 0.001  # As HF: avoid a zero-width ramp.
  ramp_f = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
  extrapolation_f = 1.0 - ramp_f  # 1: keep the original (high) frequency.
  inv_f = _unscaled(theta, dim)
  inv_f = inv_f / factor * (1.0 - extrapolation_f) + inv_f * extrapolation_f
  attn = cfg.yarn_attn_factor
  if attn is None:
    attn = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
  return inv_f, float(attn)


def _llama3(cfg: ModelConfig, seq_len) -> tuple[np.ndarray, float]:
  low_ff, high_ff = cfg.llama3_low_freq_factor, cfg.llama3_high_freq_factor
  if not 0 < low_ff < high_ff:
    raise ValueError(f"ModelConfig.llama3_high_freq_factor={high_ff!r}: need "
                     f"0 < llama3_low_freq_factor={low_ff!r} < llama3_high_freq_factor")
  factor, orig = cfg.rope_scaling_factor, cfg.rope_original_len
  inv_f = _unscaled(cfg.rope_theta, rotary_dim(cfg))
  wavelen_f = 2 * math.pi / inv_f
  low_freq_wavelen, high_freq_wavelen = orig / low_ff, orig / high_ff
  scaled_f = np.where(wavelen_f > low_freq_wavelen, inv_f / factor, inv_f)
  smooth_f = (orig / wavelen_f - low_ff) / (high_ff - low_ff)
  smoothed_f = (1 - smooth_f) * scaled_f / factor + smooth_f * scaled_f
  medium_f = (wavelen_f >= high_freq_wavelen) & (wavelen_f <= low_freq_wavelen)
  return np.where(medium_f, smoothed_f, scaled_f), 1.0


_SCALINGS: dict[str, Callable[[ModelConfig, Any], tuple[Any, float]]] = {
    "none": _none, "linear": _linear, "ntk": _ntk, "dynamic_ntk": _dynamic_ntk,
    "yarn": _yarn, "llama3": _llama3,
}
# ModelConfig.validate admits exactly these names, so the lookup below cannot miss.
assert tuple(_SCALINGS) == ROPE_SCALINGS, (tuple(_SCALINGS), ROPE_SCALINGS)


def rope_inv_freq(cfg: ModelConfig, seq_len=None) -> tuple[jax.Array, float | jax.Array]:
  """(inv_freq_f float32 with F = rotary_dim // 2, attention factor on cos/sin).

  `seq_len` (int or traced int32 scalar) is read only by "dynamic_ntk"; None
  there means "not longer than the original context", i.e. unscaled.
  """
  inv_f, attn = _SCALINGS[cfg.rope_scaling](cfg, seq_len)
  return jnp.asarray(inv_f, jnp.float32), attn


def _computed_once(*xs: jax.Array) -> tuple[jax.Array, ...]:
  """xs, each evaluated once into memory rather than inside its consumers.

  XLA fuses an elementwise producer into every consumer: cos and sin of [B, L, 1, F]
  angles, broadcast over the heads of q and k, were evaluated again per head and per
  pass (forward, backward), a visible share of the train step (docs/PERFORMANCE.md,
  "Second round"). A reduction is not fused into its consumers, so each value is
  summed with zeros through one. (`jax.lax.optimization_barrier` is gone before fusion.)
  """
  stacked = jnp.stack([jnp.stack(xs), jnp.zeros((len(xs),) + xs[0].shape, xs[0].dtype)])
  return tuple(stacked.sum(axis=0))


def apply_rope_grouped(x_BLKGH: jax.Array, positions_BL: jax.Array, cfg: ModelConfig,
                       seq_len=None) -> jax.Array:
  """`apply_rope` for query heads grouped by KV head, [B, L, K, G, H]."""
  chex.assert_rank(x_BLKGH, 5)
  B, L, K, G, H = x_BLKGH.shape
  x_BLNH = x_BLKGH.reshape(B, L, K * G, H)
  return apply_rope(x_BLNH, positions_BL, cfg, seq_len).reshape(B, L, K, G, H)


def apply_rope(x_BLNH: jax.Array, positions_BL: jax.Array, cfg: ModelConfig,
               seq_len=None) -> jax.Array:
  """Rotates the first rotary_dim dims of x's last axis by position; the rest pass.

  x is [B, L, heads, H] (query heads N, KV heads K, or one shared key: 1; grouped
  queries: `apply_rope_grouped`); positions are [B,L] (or [1,L]) and broadcast
  over the head axis. Computed in float32, returned in x.dtype. For
  "dynamic_ntk" with seq_len=None, seq_len = max(positions) + 1 (as HF's
  forward does), so one full-sequence call matches HF.
  """
  chex.assert_rank(x_BLNH, 4)
  chex.assert_rank(positions_BL, 2)
  B, L, H = x_BLNH.shape[0], x_BLNH.shape[1], x_BLNH.shape[-1]
  if positions_BL.shape[1] != L or positions_BL.shape[0] not in (1, B):
    raise ValueError(f"apply_rope: positions shape {positions_BL.shape} does not fit "
                     f"x shape {x_BLNH.shape} (want [{B} or 1, {L}])")
  if H != cfg.resolved_head_dim:
    raise ValueError(f"apply_rope: x head dim {H} != ModelConfig.head_dim "
                     f"{cfg.resolved_head_dim}")
  P = rotary_dim(cfg)  # The rotated dims (model/__init__.py's legend).
  F = P // 2
  if seq_len is None and cfg.rope_scaling == "dynamic_ntk":
    seq_len = jnp.max(positions_BL) + 1
  inv_f, attn = rope_inv_freq(cfg, seq_len)
  angle_BLf = positions_BL.astype(jnp.float32)[:, :, None] * inv_f[None, None, :]
  angle_BL1F = angle_BLf[:, :, None]
  cos, sin = _computed_once(jnp.cos(angle_BL1F) * attn, jnp.sin(angle_BL1F) * attn)

  x = x_BLNH.astype(jnp.float32)
  x_rot, x_pass = x[..., :P], x[..., P:]
  if cfg.rope_layout == "split_half":  # Pairs (i, i + F): GPT-NeoX / Llama rotate_half.
    a, b = x_rot[..., :F], x_rot[..., F:]
    rotated = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
  else:  # "interleaved" (ModelConfig.validate): pairs (2i, 2i + 1), RoFormer / GPT-J.
    pairs = x_rot.reshape(x_rot.shape[:-1] + (F, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1)
    rotated = rotated.reshape(x_rot.shape)
  out = jnp.concatenate([rotated, x_pass], axis=-1) if P < H else rotated
  return out.astype(x_BLNH.dtype)


# Absolute encodings ---------------------------------------------------------


def sinusoidal_embedding(positions_BL: jax.Array, d_model: int,
                         max_wavelength: float = 10_000.0) -> jax.Array:
  """Vaswani et al. (2017) encodings, [B,L,D] float32.

  Pair i has angle pos / max_wavelength**(2i/D), as in the paper, but the sines
  fill the first half and the cosines the second (out[..., i] = sin, out[...,
  D/2 + i] = cos) instead of alternating: a fixed permutation of the paper's
  dims, which the first projection absorbs, and no strided reshape.
  """
  chex.assert_rank(positions_BL, 2)
  if d_model <= 0 or d_model % 2:
    raise ValueError(f"sinusoidal_embedding: d_model={d_model} must be positive and even")
  inv_timescale_f = 1.0 / max_wavelength ** (np.arange(0, d_model, 2, dtype=np.float64) / d_model)
  angle_BLf = (positions_BL.astype(jnp.float32)[:, :, None] *
               jnp.asarray(inv_timescale_f, jnp.float32)[None, None, :])
  return jnp.concatenate([jnp.sin(angle_BLf), jnp.cos(angle_BLf)], axis=-1)


class LearnedPositionalEmbedding(nn.Module):
  """A trained [max_seq_len, D] table, looked up by position.

  `init_std` is the token embedding's (model/layers.py embedding_std), as GPT-2
  initialises its token and position tables at the same scale (0.02 / 0.01): the
  position rows start as large as the token rows they are added to. (With a
  0.02 table under a unit-variance token table, position was ~3% of the input and
  a trained "learned" model matched NoPE to three decimals.)

  Rows past the training length are never trained: they keep their random init,
  so evaluating beyond it measures exactly the table's failure to extrapolate.
  Positions >= max_seq_len are out of the table: jnp.take fills them with NaN
  (loud, rather than silently clamping to the last row).
  """

  max_seq_len: int
  d_model: int
  init_std: float
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, positions_BL: jax.Array) -> jax.Array:
    chex.assert_rank(positions_BL, 2)
    table_LD = self.param(
        "embedding",
        nn.with_logical_partitioning(nn.initializers.normal(self.init_std), (None, "embed")),
        (self.max_seq_len, self.d_model), jnp.dtype(self.param_dtype))
    return jnp.take(table_LD, positions_BL, axis=0)

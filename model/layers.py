"""The parameter layer: one Einsum module, norms, embeddings and the dense FFN.

Every parameter is declared with its logical axis names where it is used;
parallel/rules.py alone maps those names to mesh axes.
"""

from __future__ import annotations

from typing import Callable, Sequence

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from model.config import ModelConfig

Initializer = Callable[..., jax.Array]


def dtype_of(name: str) -> jnp.dtype:
  return jnp.dtype(name)


class Einsum(nn.Module):
  """A weight of `shape` (logical `axes`) contracted with the input by `eqn`.

  Inputs and weight are cast to the compute dtype and accumulated in float32
  (`preferred_element_type`): bfloat16 inputs with float32 accumulation is the
  fast matmul path on TPU, GPU and AMX CPUs, without losing the sum's precision.
  """

  shape: Sequence[int]
  axes: Sequence[str | None]
  dtype: str = "float32"
  param_dtype: str = "float32"
  init_std: float = 0.02
  fan_in_axes: Sequence[int] | None = None  # None: normal(init_std).

  @nn.compact
  def __call__(self, eqn: str, x: jax.Array) -> jax.Array:
    if self.fan_in_axes is None:
      init = nn.initializers.normal(self.init_std)
    else:
      init = nn.initializers.variance_scaling(
          1.0, "fan_in", "truncated_normal", in_axis=tuple(self.fan_in_axes),
          out_axis=tuple(i for i in range(len(self.shape)) if i not in self.fan_in_axes))
    w = self.param("w", nn.with_logical_partitioning(init, tuple(self.axes)),
                   tuple(self.shape), dtype_of(self.param_dtype))
    dtype = dtype_of(self.dtype)
    y = jnp.einsum(eqn, x.astype(dtype), w.astype(dtype),
                   preferred_element_type=jnp.float32)
    return y.astype(dtype)


class Bias(nn.Module):
  shape: Sequence[int]
  axes: Sequence[str | None]
  param_dtype: str = "float32"

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    b = self.param("b", nn.with_logical_partitioning(nn.initializers.zeros, tuple(self.axes)),
                   tuple(self.shape), dtype_of(self.param_dtype))
    return x + b.astype(x.dtype).reshape((1,) * (x.ndim - b.ndim) + b.shape)


class Norm(nn.Module):
  """RMSNorm or LayerNorm over the last axis, computed in float32."""

  kind: str = "rmsnorm"
  eps: float = 1e-6
  axis_name: str = "embed"
  dtype: str = "float32"
  param_dtype: str = "float32"

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    dim = x.shape[-1]
    scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones,
                                                             (self.axis_name,)),
                       (dim,), dtype_of(self.param_dtype))
    x32 = x.astype(jnp.float32)
    bcast = lambda p: p.astype(jnp.float32).reshape((1,) * (x.ndim - 1) + (dim,))
    if self.kind == "rmsnorm":
      y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
      y = y * bcast(scale)
    else:
      bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros,
                                                             (self.axis_name,)),
                        (dim,), dtype_of(self.param_dtype))
      mean = jnp.mean(x32, axis=-1, keepdims=True)
      var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
      y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
      y = y * bcast(scale) + bcast(bias)
    return y.astype(dtype_of(self.dtype))


def make_norm(cfg: ModelConfig, name: str | None = None, axis_name: str = "embed") -> Norm:
  return Norm(kind=cfg.norm, eps=cfg.norm_eps, axis_name=axis_name, dtype=cfg.dtype,
              param_dtype=cfg.param_dtype, name=name)


def embedding_std(cfg: ModelConfig) -> float:
  """Init std of the token embedding's entries, which sets the scale of the residual
  stream's input. Untied: 1 (unit-variance entries). Tied: the table is also the
  output head, so it starts at the head's scale (1/sqrt(D): unit-variance initial
  logits) and logits are h @ E^T, unscaled, as in Hugging Face's tied models (exact
  import/export, see interop/). An additive positional signal (learned, sinusoidal)
  is put on this same scale (model/positional.py), so position is never a few
  percent of the input by accident of an init constant."""
  return cfg.d_model ** -0.5 if cfg.tie_embeddings else 1.0


class Embedder(nn.Module):
  """Token embedding and (tied or separate) output projection to logits."""

  cfg: ModelConfig

  def setup(self):
    cfg = self.cfg
    std = embedding_std(cfg)
    self.embedding = self.param(
        "embedding", nn.with_logical_partitioning(nn.initializers.normal(std),
                                                  ("vocab", "embed")),
        (cfg.vocab_size, cfg.d_model), dtype_of(cfg.param_dtype))
    if not cfg.tie_embeddings:
      self.unembed = Einsum((cfg.d_model, cfg.vocab_size), ("embed", "vocab"),
                            dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                            init_std=cfg.d_model ** -0.5)

  def encode(self, tokens_BL: jax.Array) -> jax.Array:
    # Gather from a table whole along D: a gather from an fsdp-sharded D axis
    # makes XLA rematerialise the full table on every device.
    table_VD = nn.with_logical_constraint(self.embedding, ("vocab", None))
    x_BLD = jnp.take(table_VD, tokens_BL, axis=0)
    return x_BLD.astype(dtype_of(self.cfg.dtype))

  def decode(self, x_BLD: jax.Array) -> jax.Array:
    """Logits in float32 (the loss and sampling need the precision)."""
    cfg = self.cfg
    if cfg.tie_embeddings:
      dtype = dtype_of(cfg.dtype)
      logits_BLV = jnp.einsum("BLD,VD->BLV", x_BLD.astype(dtype), self.embedding.astype(dtype),
                              preferred_element_type=jnp.float32)
    else:
      logits_BLV = self.unembed("BLD,DV->BLV", x_BLD)
    return logits_BLV.astype(jnp.float32)


class FeedForward(nn.Module):
  """Dense FFN: gated (SwiGLU, GeGLU) or plain (GELU, ReLU)."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BLD: jax.Array, deterministic: bool = True) -> jax.Array:
    cfg = self.cfg
    D, F = cfg.d_model, cfg.mlp_dim
    kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, init_std=cfg.init_std)
    h_BLF = Einsum((D, F), ("embed", "mlp"), name="wi", **kw)("BLD,DF->BLF", x_BLD)
    if cfg.ffn in ("swiglu", "geglu"):
      gate_BLF = Einsum((D, F), ("embed", "mlp"), name="wg", **kw)("BLD,DF->BLF", x_BLD)
      act = nn.silu if cfg.ffn == "swiglu" else nn.gelu
      h_BLF = act(gate_BLF) * h_BLF
    else:
      h_BLF = nn.gelu(h_BLF) if cfg.ffn == "gelu" else nn.relu(h_BLF)
    h_BLF = nn.with_logical_constraint(h_BLF, ("batch", "length", "mlp"))
    out_BLD = Einsum((F, D), ("mlp", "embed"), name="wo", **kw)("BLF,FD->BLD", h_BLF)
    chex.assert_equal_shape([x_BLD, out_BLD])
    return out_BLD

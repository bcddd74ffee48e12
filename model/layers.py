"""The parameter layer: one Einsum module, norms, embeddings and the dense FFN.

Every parameter is declared with its logical axis names where it is used;
parallel/rules.py alone maps those names to mesh axes.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from model import mup, quantization
from model.config import FFN_TYPES, ModelConfig
from parallel.context import context_axis_size
from parallel.pipeline_1f1b_common import vectors_whole

Initializer = Callable[..., jax.Array]

# ModelConfig.ffn -> (nonlinearity, gated). A gated FFN has a third weight wg and
# computes act(x wg) * (x wi); a plain one act(x wi). flax nn.gelu is the tanh form.
ACTIVATIONS: dict[str, tuple[Callable[[jax.Array], jax.Array], bool]] = {
    "swiglu": (nn.silu, True), "geglu": (nn.gelu, True),
    "gelu": (nn.gelu, False), "relu": (nn.relu, False),
}
# ModelConfig.validate admits exactly these names, so a lookup cannot miss.
assert tuple(ACTIVATIONS) == FFN_TYPES, (tuple(ACTIVATIONS), FFN_TYPES)


def is_gated(ffn: str) -> bool:
  """Whether ModelConfig.ffn=`ffn` has a gate weight (wg)."""
  return ACTIVATIONS[ffn][1]


def activate(h: jax.Array, gate: jax.Array | None, ffn: str) -> jax.Array:
  """The FFN nonlinearity: act(gate) * h if gated, else act(h); in h's dtype. Its inputs
  carry model/remat.py's (MaxText's) names: gated, the gate is mlpwi_0 and h mlpwi_1;
  ungated, h is mlpwi (the dense FFN's and the MoE experts' alike)."""
  act, gated = ACTIVATIONS[ffn]
  if gated:
    return act(checkpoint_name(gate, "mlpwi_0")) * checkpoint_name(h, "mlpwi_1")
  return act(checkpoint_name(h, "mlpwi"))


def einsum_rows(eqn: str, x: jax.Array, w: jax.Array, einsum: Callable = jnp.einsum,
                **kw) -> jax.Array:
  """jnp.einsum(eqn, x, w, **kw) with x's leading pass-through dims (those that lead
  the output too and are not in w: "BL" in "BLD,DF->BLF") merged into one row dim.

  Same math; it is for speed. Contracting a weight gradient over two dims (B, L)
  makes XLA:CPU transpose the [B, L, F] cotangent into [F, B*L] before the dot (the
  largest cost of the float32 train step at config S, docs/PERFORMANCE.md); over one
  row dim the dot reads both operands as they are. Merging keeps the batch sharding
  only while "length" is unsharded: under context parallelism (parallel/rules.py,
  "length" over "context") the merged rows would not be one tile per device, and GSPMD
  would gather them, so there it is the plain einsum.
  """
  ins, out = eqn.replace(" ", "").split("->")
  xs, ws = ins.split(",")
  if context_axis_size() > 1:
    return einsum(eqn, x, w, **kw)
  n = 0
  while n < len(xs) and xs[n] not in ws and out[:n + 1] == xs[:n + 1]:
    n += 1
  if n < 2:
    return einsum(eqn, x, w, **kw)
  row = next(c for c in "MRTZYXW" if c not in eqn)
  lead = x.shape[:n]
  y = einsum(f"{row}{xs[n:]},{ws}->{row}{out[n:]}", x.reshape(-1, *x.shape[n:]), w, **kw)
  return y.reshape(*lead, *y.shape[1:])


def _einsum_f32(eqn: str, x: jax.Array, w: jax.Array) -> jax.Array:
  return jnp.einsum(eqn, x, w, preferred_element_type=jnp.float32).astype(x.dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def lowp_einsum(eqn: str, x: jax.Array, w: jax.Array) -> jax.Array:
  """einsum(eqn, x, w) accumulated in float32, in x's dtype (bfloat16), whose input
  gradient comes out of its matmul in that dtype.

  Autodiff of a float32-accumulated dot rounded to bfloat16 widens the cotangent to
  float32 and runs the input gradient's matmul in float32: where that matmul's sum is
  split over chips (a column-parallel projection's heads or mlp over tensor), the partial
  sums cross the network and wait in memory at twice their size, an activation-sized
  float32 buffer per projection (the 405b row's largest, docs/PERFORMANCE.md). Here the
  input gradient is a bfloat16 matmul (float32 accumulation inside the MXU / GEMM, one
  rounding), as MaxText's projections compute it; on one device it is the same value.
  The weight gradient is autodiff's: float32, reduced over the batch's chips in float32,
  then rounded to the weight's compute dtype.

  A JVP rule, not a VJP: autodiff transposes its linear terms (any equation, no
  hand-written gradient einsums), and remat policies see ordinary dots. Measured against
  the custom VJP tried first: the same remat-policy figures, and 405b's temporaries 19.56
  against 20.26 GiB (docs/PERFORMANCE.md).
  """
  return _einsum_f32(eqn, x, w)


@lowp_einsum.defjvp
def _lowp_einsum_jvp(eqn, primals, tangents):
  x, w = primals
  tx, tw = tangents
  # The x term's transpose is a dot at preferred_element_type=x.dtype: dx in bfloat16.
  ty = (jnp.einsum(eqn, tx, w, preferred_element_type=x.dtype)
        + _einsum_f32(eqn, x, tw))
  return _einsum_f32(eqn, x, w), ty


class Einsum(nn.Module):
  """A weight of `shape` (logical `axes`) contracted with the input by `eqn`.

  Inputs and weight are cast to the compute dtype and accumulated in float32
  (`preferred_element_type`): bfloat16 inputs with float32 accumulation is the
  fast matmul path on TPU, GPU and AMX CPUs, without losing the sum's precision.
  Below float32, the input gradient's matmul runs in the compute dtype too
  (`lowp_einsum`), unless Qwix quantizes this dot (its own VJP then).
  """

  shape: Sequence[int]
  axes: Sequence[str | None]
  dtype: str = "float32"
  param_dtype: str = "float32"
  init_std: float = 0.02
  fan_in_axes: Sequence[int] | None = None  # None: normal(init_std).
  # Used whole inside the 1F1B schedules' per-stage switch (`vectors_whole`): a weight
  # split only along D whose output is not split over tensor (the MoE router's gate,
  # MLA's q_a, kv_a, k_rope) is gathered there, as FSDP does anyway, where GSPMD chose a
  # collective-permute, which deadlocks a switch (docs/scaling.md, "The 1F1B schedule").
  whole_in_stage: bool = False

  @nn.compact
  def __call__(self, eqn: str, x: jax.Array) -> jax.Array:
    if self.fan_in_axes is None:
      init = nn.initializers.normal(self.init_std)
    else:
      init = nn.initializers.variance_scaling(
          1.0, "fan_in", "truncated_normal", in_axis=tuple(self.fan_in_axes),
          out_axis=tuple(i for i in range(len(self.shape)) if i not in self.fan_in_axes))
    w = self.param("w", nn.with_logical_partitioning(init, tuple(self.axes)),
                   tuple(self.shape), jnp.dtype(self.param_dtype))
    if self.whole_in_stage and vectors_whole():
      w = nn.with_logical_constraint(w, (None,) * len(self.shape))
    dtype = jnp.dtype(self.dtype)
    lowp = dtype != jnp.float32 and not quantization.quantizes_here("einsum")
    return einsum_rows(eqn, x.astype(dtype), w.astype(dtype),
                       einsum=lowp_einsum if lowp else _einsum_f32)


class Bias(nn.Module):
  shape: Sequence[int]
  axes: Sequence[str | None]
  param_dtype: str = "float32"

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    b = self.param("b", nn.with_logical_partitioning(nn.initializers.zeros, tuple(self.axes)),
                   tuple(self.shape), jnp.dtype(self.param_dtype))
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
                       (dim,), jnp.dtype(self.param_dtype))
    x32 = x.astype(jnp.float32)
    # Inside the half-tick 1F1B schedule the [D] scale (and bias) is used whole (a tiny
    # all-gather, not a permute: parallel/pipeline_1f1b_common.py `whole_vectors`).
    whole = lambda p: nn.with_logical_constraint(p, (None,)) if vectors_whole() else p
    bcast = lambda p: whole(p.astype(jnp.float32)).reshape((1,) * (x.ndim - 1) + (dim,))
    if self.kind == "rmsnorm":
      y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
      y = y * bcast(scale)
    else:
      bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros,
                                                             (self.axis_name,)),
                        (dim,), jnp.dtype(self.param_dtype))
      mean = jnp.mean(x32, axis=-1, keepdims=True)
      var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
      y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
      y = y * bcast(scale) + bcast(bias)
    return y.astype(jnp.dtype(self.dtype))


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
        (cfg.vocab_size, cfg.d_model), jnp.dtype(cfg.param_dtype))
    if not cfg.tie_embeddings:
      self.unembed = Einsum((cfg.d_model, cfg.vocab_size), ("embed", "vocab"),
                            dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                            init_std=cfg.d_model ** -0.5)

  def encode(self, tokens_BL: jax.Array) -> jax.Array:
    # Gather from a table whole along D: a gather from an fsdp-sharded D axis
    # makes XLA rematerialise the full table on every device.
    table_VD = nn.with_logical_constraint(self.embedding, ("vocab", None))
    x_BLD = jnp.take(table_VD, tokens_BL, axis=0)
    return x_BLD.astype(jnp.dtype(self.cfg.dtype))

  def decode(self, x_BLD: jax.Array) -> jax.Array:
    """Logits in float32 (the loss and sampling need the precision)."""
    cfg = self.cfg
    if cfg.tie_embeddings:
      dtype = jnp.dtype(cfg.dtype)
      logits_BLV = einsum_rows("BLD,VD->BLV", x_BLD.astype(dtype), self.embedding.astype(dtype),
                               preferred_element_type=jnp.float32)
    else:
      logits_BLV = self.unembed("BLD,DV->BLV", x_BLD)
      if cfg.mup_base_width:  # µP's readout multiplier 1/m (model/mup.py).
        logits_BLV = logits_BLV * mup.output_multiplier(cfg)
    return logits_BLV.astype(jnp.float32)


class FeedForward(nn.Module):
  """Dense FFN: gated (SwiGLU, GeGLU) or plain (GELU, ReLU)."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BLD: jax.Array, deterministic: bool = True) -> jax.Array:
    cfg = self.cfg
    D, F = cfg.d_model, cfg.mlp_dim
    kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, init_std=mup.hidden_init_std(cfg))
    h_BLF = Einsum((D, F), ("embed", "mlp"), name="wi", **kw)("BLD,DF->BLF", x_BLD)
    gate_BLF = (Einsum((D, F), ("embed", "mlp"), name="wg", **kw)("BLD,DF->BLF", x_BLD)
                if is_gated(cfg.ffn) else None)
    h_BLF = activate(h_BLF, gate_BLF, cfg.ffn)
    h_BLF = nn.with_logical_constraint(h_BLF, ("batch", "length", "mlp"))
    out_BLD = Einsum((F, D), ("mlp", "embed"), name="wo", **kw)("BLF,FD->BLD", h_BLF)
    out_BLD = checkpoint_name(out_BLD, "mlpwo")  # model/remat.py's name (MaxText's).
    chex.assert_equal_shape([x_BLD, out_BLD])
    return out_BLD

"""model.layers.Einsum below float32: the input gradient's matmul runs in the compute
dtype (layers.lowp_einsum), the value and both gradients are autodiff's on one device, and
a dot Qwix quantizes keeps Qwix's own VJP."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import ModelConfig, Transformer, layers

# (eqn, x shape, w shape): column-parallel, row-parallel, one with a weight batch dim (E).
EQNS = [("BLD,DNH->BLNH", (2, 8, 16), (16, 4, 8)),
        ("BLNH,NHD->BLD", (2, 8, 4, 8), (4, 8, 16)),
        ("EGCD,EDF->EGCF", (2, 3, 4, 16), (2, 16, 8))]


def _autodiff(eqn, x, w):
  return layers.einsum_rows(eqn, x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def _lowp(eqn, x, w):
  return layers.einsum_rows(eqn, x, w, einsum=layers.lowp_einsum)


@pytest.mark.parametrize("eqn, x_shape, w_shape", EQNS)
def test_value_and_gradients_equal_autodiffs_on_one_device(eqn, x_shape, w_shape):
  kx, kw, kg = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, x_shape, jnp.bfloat16)
  w = jax.random.normal(kw, w_shape, jnp.bfloat16)
  want_y, want_vjp = jax.vjp(lambda a, b: _autodiff(eqn, a, b), x, w)
  got_y, got_vjp = jax.vjp(lambda a, b: _lowp(eqn, a, b), x, w)
  g = jax.random.normal(kg, want_y.shape, jnp.bfloat16)
  for got, want in zip((got_y, *got_vjp(g)), (want_y, *want_vjp(g))):
    assert got.dtype == want.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


B, L, D = 2, 8, 24


def _backward_dots(dtype: str) -> list[tuple[str, str, tuple]]:
  """(lhs dtype, output dtype, output shape) of each dot_general in a small Transformer's
  parameter gradient (its projections' rows: B * L)."""
  cfg = ModelConfig(vocab_size=56, d_model=D, num_layers=1, num_heads=2, num_kv_heads=2,
                    mlp_dim=40, max_seq_len=L, dtype=dtype, tie_embeddings=False)
  model, tokens_BL = Transformer(cfg), jnp.zeros((B, L), jnp.int32)
  params = model.init(jax.random.key(0), tokens_BL)
  loss = lambda p: jnp.sum(model.apply(p, tokens_BL).astype(jnp.float32) ** 2)
  dots = []

  def walk(jaxpr):
    for e in jaxpr.eqns:
      if e.primitive.name == "dot_general":
        dots.append((str(e.invars[0].aval.dtype), str(e.outvars[0].aval.dtype),
                     tuple(e.outvars[0].aval.shape)))
      for sub in jax.extend.core.jaxprs_in_params(e.params):
        walk(sub)

  walk(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)
  return dots


def test_bfloat16_input_gradients_are_bfloat16_matmuls():
  """In a bfloat16 model's gradient, the matmuls whose output is [rows, D] (the input
  gradients of q, k, v, wi, wg and the head: the residual stream's width, summed over
  tensor where heads or mlp are split) come out in bfloat16, not as float32 buffers at
  twice the size (the 405b row's largest, docs/PERFORMANCE.md). float32 models keep
  float32 throughout."""
  residual = {(B * L, D), (B, L, D)}
  wide = [d for d in _backward_dots("bfloat16") if d[2] in residual]
  # q, k, v, wi, wg and unembed's input gradients (o and wo's forwards, accumulated in
  # float32 before their rounding, are [rows, D] too).
  assert sum(out == "bfloat16" for _, out, _ in wide) == 6, wide
  assert not [d for d in wide if d[0] == "float32"], wide  # No float32 cotangent matmul.
  assert all(out == "float32" for _, out, _ in _backward_dots("float32"))

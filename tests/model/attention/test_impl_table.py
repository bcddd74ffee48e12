"""Every entry of the attention implementation table equals the reference ("xla").

One test walks model/attention/impls.py's IMPLS instead of naming pairs: a new entry is
covered, or fails here until it says how it runs on CPU (PORTABLE) or why it cannot
(SKIPPED). The reference itself is checked against an independent numpy computation of the
same masks and biases. Shapes are tiny; L = 40 is not a multiple of the 16-long blocks (one
case pairs them with 8-long key blocks), so padding, unequal blocks and the causal / window
block skipping are all exercised. A kernel that cannot express a case (kernels.kernel_gaps)
must refuse it by name, not run it wrongly.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.attention import kernels, scores
from model.attention.impls import IMPLS
from model.attention.reference import AttnData, AttnSpec, xla_attention

B, L, H = 2, 40, 8
# Two packed documents then padding (segment 0), and two documents; positions restart.
SEG_BL = np.array([[1] * 15 + [2] * 20 + [0] * 5, [3] * 12 + [4] * 28], np.int32)
POS_BL = np.array([list(range(15)) + list(range(20)) + [0] * 5,
                   list(range(12)) + list(range(28))], np.int32)
DATA = AttnData(jnp.asarray(SEG_BL), jnp.asarray(SEG_BL), jnp.asarray(POS_BL),
                jnp.asarray(POS_BL))
CASES = {  # name: (K, G, AttnSpec options)
    "mha": (4, 1, {}),
    "gqa_window": (2, 2, dict(sliding_window=5)),
    "mqa_softcap": (1, 4, dict(softcap=2.0)),
    "gqa_alibi": (2, 2, dict(alibi=True)),
    "gqa_all_uneven_blocks": (2, 2, dict(sliding_window=7, softcap=1.5, alibi=True,
                                         block_kv=8)),
}
TOL = dict(rtol=1e-5, atol=1e-6)
# How each vendor kernel runs on any backend: cuDNN's translation of the spec through
# jax.nn.dot_product_attention's XLA implementation, Splash in the Pallas interpreter.
PORTABLE = {
    "cudnn": functools.partial(kernels.cudnn_attention, implementation="xla"),
    "splash": functools.partial(kernels.splash_attention,
                                interpret=jax.default_backend() != "tpu"),
}
SKIPPED: dict[str, str] = {}  # name: why it cannot run here at all (none today).


def qkv(K, G, seed=0):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(kq, (B, L, K, G, H)), jax.random.normal(kk, (B, L, K, H)),
          jax.random.normal(kv, (B, L, K, H)))


def loss_and_grads(fn, spec, q, k, v):
  """out and d(sum(out * w))/d(q, k, v) for a fixed random w, jitted."""
  w = jax.random.normal(jax.random.key(9), q.shape)
  loss = lambda q, k, v: jnp.sum(fn(q, k, v, DATA, spec) * w)
  return jax.jit(lambda q, k, v: (fn(q, k, v, DATA, spec),
                                  jax.grad(loss, argnums=(0, 1, 2))(q, k, v)))(q, k, v)


def assert_trees_close(got, want, what):
  assert jax.tree.structure(got) == jax.tree.structure(want), what
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, **TOL, err_msg=f"{what} {jax.tree_util.keystr(path)}")


def numpy_attention(q, k, v, spec: AttnSpec):
  """Causal / window / segment mask, soft-cap and ALiBi written out in float64 numpy."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  _, _, K, G, _ = q.shape
  s = np.einsum("blkgh,bskh->bkgls", q, k) * spec.scale
  if spec.softcap:
    s = spec.softcap * np.tanh(s / spec.softcap)
  if spec.alibi:
    slopes = scores.alibi_slopes(K * G).reshape(K, G).astype(np.float64)
    dist = (POS_BL[:, :, None] - POS_BL[:, None, :]).astype(np.float64)
    s = s - slopes[None, :, :, None, None] * dist[:, None, None]
  ql, ks = np.arange(L)[:, None], np.arange(L)[None, :]
  visible = (ks <= ql) & ((ql - ks < spec.sliding_window) if spec.sliding_window else True)
  visible = visible[None] & (SEG_BL[:, :, None] == SEG_BL[:, None, :])
  s = np.where(visible[:, None, None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  return np.einsum("bkgls,bskh->blkgh", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_every_implementation_equals_the_reference(impl, case):
  if impl in SKIPPED:
    pytest.skip(SKIPPED[impl])
  K, G, opts = CASES[case]
  spec = AttnSpec(scale=H ** -0.5, block_q=16, **{"block_kv": 16, **opts})
  q, k, v = qkv(K, G)
  if impl == "xla":
    got = jax.jit(xla_attention, static_argnums=4)(q, k, v, DATA, spec)
    np.testing.assert_allclose(got, numpy_attention(q, k, v, spec), rtol=1e-5, atol=1e-5,
                               err_msg=f"xla vs numpy ({case})")
    return
  fn = PORTABLE.get(impl, IMPLS[impl])
  gaps = kernels.kernel_gaps(impl, spec)
  if gaps:  # Refused by name, never run without what it cannot express.
    with pytest.raises(ValueError, match=re.escape(f"attention_impl={impl!r}: {gaps[0]}")):
      fn(q, k, v, DATA, spec)
    return
  want = loss_and_grads(xla_attention, spec, q, k, v)
  got = loss_and_grads(fn, spec, q, k, v)
  assert_trees_close(got, want, f"{impl} vs xla ({case}): output, dq, dk, dv")


def test_the_table_is_covered():
  """Every entry runs here, natively or through PORTABLE, or says why it cannot."""
  # "ring" natively is a ring of one device; on a context mesh: tests/parallel/test_context.py.
  native = {"xla", "blockwise", "ring"}
  assert set(IMPLS) == native | set(PORTABLE) | set(SKIPPED), sorted(IMPLS)

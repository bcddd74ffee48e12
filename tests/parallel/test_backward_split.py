"""parallel/backward_split.py: a stage's backward split into B (the input's gradient) and W
(the weight gradients) is the backward, and W is only the work B did not do."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import ModelConfig
from model.pipelined import StageStack
from parallel import backward_split


def _flops(fn, *args) -> float:
  return jax.jit(fn).lower(*args).compile().cost_analysis()["flops"]


def _stage_split(dtype: str, remat: str):
  """Two of the model's layers (GQA, RoPE, gated FFN) as a pipeline stage: its backward
  split, and what to run and compare it with."""
  cfg = ModelConfig(vocab_size=64, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    mlp_dim=256, max_seq_len=32, pos_encoding="rope", dtype=dtype,
                    remat=remat)
  kinds = (cfg.layer_kind(0),)
  stack = StageStack(cfg, "layers", False, kinds, 2)
  x_BLD = jax.random.normal(jax.random.key(0), (4, 32, 64), dtype)
  positions_BL = jnp.broadcast_to(jnp.arange(32), (4, 32))
  segments_BL = jnp.ones((4, 32), jnp.int32)
  params = nn.unbox(stack.init(jax.random.key(1), x_BLD, positions_BL, segments_BL))
  dy_BLD = jax.random.normal(jax.random.key(2), (4, 32, 64), dtype)
  one = jnp.ones((), jnp.float32)

  def forward(p, x):
    return (stack.apply(p, x, positions_BL, segments_BL), jnp.zeros((), jnp.float32)), {}

  _, vjp, _ = jax.vjp(forward, params, x_BLD, has_aux=True)
  leaves, treedef = jax.tree.flatten(vjp)
  param_leaves = jax.tree.leaves(params)
  source = [next((j for j, q in enumerate(param_leaves) if l is q), None) for l in leaves]
  kept = [l for l, s in zip(leaves, source) if s is None]

  def backward(pl, kl, dy, one):
    stored = iter(kl)
    full = [pl[s] if s is not None else next(stored) for s in source]
    d_params, dx = jax.tree.unflatten(treedef, full)((dy, one))
    return jax.tree.leaves(d_params), dx

  split = backward_split.split(backward, param_leaves, kept, dy_BLD, one)
  return split, backward, param_leaves, kept, dy_BLD, one


# One case in make test's budget; the other five in the slow tier.
@pytest.mark.parametrize("dtype, tol, remat", [
    ("float32", 1e-6, "none"),
    *(pytest.param(*case, marks=pytest.mark.slow) for case in (
        ("bfloat16", 0, "full"), ("bfloat16", 0, "none"), ("float32", 1e-6, "full"),
        ("float32", 1e-6, "minimal"), ("bfloat16", 0, "minimal")))])
def test_the_model_stages_backward_splits_into_b_and_w_without_recomputing(dtype, tol, remat):
  """B's input gradient and B's and W's parameter gradients equal the whole backward's
  (bfloat16: bitwise); B holds no weight gradient's matmul and W no input gradient's:
  their FLOPs add up to the backward's, within 5% (a remat policy's recomputation is B's,
  once; remat='full' in bfloat16 measured 2.4% over), and W's are over a fifth of it (the
  weight gradients' matmuls)."""
  split, backward, param_leaves, kept, dy_BLD, one = _stage_split(dtype, remat)
  b = lambda pl, kb, dy: backward_split.run_b(split, pl, kb, dy, one)
  w = lambda pl, kl, stash: backward_split.run_w(split, pl, kl, stash)
  b_outs, stash = jax.jit(b)(param_leaves, kept, dy_BLD)
  w_outs = jax.jit(w)(param_leaves, kept, stash)
  want_dp, want_dx = jax.jit(backward)(param_leaves, kept, dy_BLD, one)
  assert sum(split.out_in_w) >= 6, "W should take the projections' weight gradients"
  for got_b, got_w, want in zip(b_outs, w_outs, [*want_dp, want_dx]):
    got = got_w if got_b is None else got_b
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=tol, atol=tol)

  flops_b = _flops(b, param_leaves, kept, dy_BLD)
  flops_w = _flops(lambda pl, kl, st: [o for o in w(pl, kl, st) if o is not None],
                   param_leaves, kept, stash)
  flops = _flops(lambda pl, kl, dy: backward(pl, kl, dy, one), param_leaves, kept, dy_BLD)
  assert flops_b + flops_w == pytest.approx(flops, rel=0.05), (flops_b, flops_w, flops)
  assert flops_w > flops / 5, (flops_b, flops_w, flops)



def test_the_stash_is_each_projections_input_and_output_cotangent_once():
  """Under remat='full' in bfloat16 (the 1b preset's), what B hands W per layer is what
  the seven weight gradients' matmuls read, once each: the projections' inputs (the two
  normed inputs, the attention's output, the FFN's gated product) and their outputs'
  cotangents (q, k, v, out; gate, up, down), plus the two norm scales' gradients, which B
  computes (two float32 activations each, were they W's). Repeated reshapes of one value
  and the norms' float32 operands each doubled the stash."""
  split, *_ = _stage_split("bfloat16", "full")
  tokens, d, f, kv = 4 * 32, 64, 256, 2 * 16
  inputs, cotangents = 3 * d + f, 3 * d + 2 * kv + 2 * f
  per_layer = tokens * (inputs + cotangents) * 2 + 2 * d * 4
  assert all(s.shape[0] == 2 for s in split.stash), split.stash  # Stacked per layer.
  assert sum(s.size * s.dtype.itemsize for s in split.stash) == 2 * per_layer, split.stash

"""train.optimizer='kron' (PSGD Kron from psgdax): its first update against psgdax's own
preconditioner with the decay mask, the lr and the clip applied by hand, each layer of a
scanned stack preconditioned apart, and training through launch.py with a bitwise resume."""

import jax
import numpy as np
import pytest
from flax import traverse_util

from tests.cli import launch
from tests.train.test_optimizers import (CLIP, LR, RUN, WD, _clipped, _flat, _setup,
                                         _train_losses)
from train import load_run
from train.optim import decay_mask, make_optimizer
from train.optimizers import param_axes

psgdax = pytest.importorskip("psgdax")
FFN = ("layers", "ffn", "wi", "w")  # A scanned [layers, D, F] weight.


def test_first_update_is_psgd_kron_with_our_decay_lr_and_clip():
  cfg, t, params, grads = _setup("kron")
  opt = make_optimizer(t, cfg)
  got = _flat(jax.jit(opt.update)(grads, opt.init(params), params)[0])
  # The reference: psgdax's preconditioner alone on the clipped gradients (scanned leaves
  # marked by hand from their `layers` axis), then decay and lr as AdamW applies them.
  g = traverse_util.unflatten_dict({k: np.float32(v) for k, v in _clipped(grads).items()})
  scanned = jax.tree.map(lambda x: x.ndim >= 2 and x.shape[0] == cfg.num_layers, params)
  scanned = traverse_util.unflatten_dict(
      {k: v and k[0] == "layers" for k, v in traverse_util.flatten_dict(scanned).items()})
  pre = psgdax.scale_by_kron(b1=t.b1, scanned_layers=scanned, preconditioner_init_scale=None)
  with jax.numpy_rank_promotion("allow"):  # psgdax's own broadcasting (train/optimizers.py).
    direction = _flat(pre.update(g, pre.init(params), params)[0])
  p, decays = _flat(params), traverse_util.flatten_dict(decay_mask(params, t))
  assert got.keys() == direction.keys()
  for k in got:
    want = -LR * (direction[k] + WD * p[k] * decays[k])
    np.testing.assert_allclose(got[k], want, rtol=1e-5, atol=1e-6 * LR, err_msg=str(k))
  # PSGD's preconditioned step has RMS at most 1 (psgdax's grad_clip_max_amp): the FFN's.
  assert np.sqrt(np.mean(direction[FFN] ** 2)) <= 1.0 + 1e-6
  assert t.grad_clip == CLIP  # The clip came first, as for every optimizer.


def test_each_layer_of_a_scanned_stack_is_preconditioned_apart():
  """Each layer's Kronecker factors are fitted to its own gradient alone (psgdax's final
  RMS clip of the preconditioned step is over the whole stacked leaf: docs/training.md)."""
  cfg, t, params, grads = _setup("kron")
  t.grad_clip = 0.0  # A global-norm clip would couple the layers through the norm.
  assert param_axes(cfg)[FFN][0] == "layers"
  opt = make_optimizer(t, cfg)
  state = opt.init(params)
  assert all(q.shape[0] == cfg.num_layers for q in _factors(state))  # A set per layer.
  update = jax.jit(opt.update)
  bumped = jax.tree.map(lambda x: x, grads)
  bumped["layers"]["ffn"]["wi"]["w"] = grads["layers"]["ffn"]["wi"]["w"].at[1].multiply(3.0)
  after = [_factors(update(g, state, params)[1]) for g in (grads, bumped)]
  for base, moved in zip(*after):  # Layer 0's factors never see layer 1's gradient.
    np.testing.assert_array_equal(moved[0], base[0])
  assert not all(np.allclose(m[1], b[1]) for b, m in zip(*after))


def _factors(state):
  kind = psgdax.psgd.KronState
  kron = next(s for s in jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, kind))
              if isinstance(s, kind))
  return [np.asarray(q) for q in kron.Qs_preconditioners["layers"]["ffn"]["wi"]["w"]]


@pytest.mark.parametrize("name", ["kron"])
def test_trains_through_launch_and_resumes_bitwise(tmp_path, name):
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  launch("--workdir", str(straight), *RUN, f"--config.train.optimizer={name}",
         "--config.train.steps=8")  # PSGD's first steps are noisy: 8 to see it learn.
  run = load_run(str(straight))
  assert run.config.train.optimizer == name
  losses = _train_losses(straight)
  assert len(losses) == 8 and all(np.isfinite(losses)) and losses[-1] < losses[0]
  launch("--workdir", str(resumed), *RUN, f"--config.train.optimizer={name}",
         "--config.train.steps=4")
  launch("--workdir", str(resumed), *RUN, f"--config.train.optimizer={name}",
         "--config.train.steps=8")
  assert _train_losses(resumed) == losses
  for a, b in zip(jax.tree.leaves(load_run(str(resumed)).variables),
                  jax.tree.leaves(run.variables)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

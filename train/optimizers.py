"""The optimizer family behind `train.optimizer` (docs/training.md, "Optimizers").

Each entry builds the update direction, weight decay and learning rate of one optimizer
from optax's own transformations; train/optim.py's make_optimizer adds what every one
shares (global-norm clipping before, µP's hidden-matrix scale after) and wraps the result
so that its state carries the parameters' logical names (`named_state`).

  adamw                optax.adamw: the default, numbers as before the family existed.
  adafactor            optax.scale_by_factored_rms (Shazeer & Stern 2018): factored second
                       moments for dims >= 128, update clipped to block RMS 1, no momentum;
                       weight decay and lr applied as AdamW applies them.
  lion                 optax.lion (Chen et al. 2023): sign of the interpolated momentum.
  muon                 optax.contrib.scale_by_muon's momentum and Newton-Schulz (Jordan 2024;
                       5 steps) on the hidden matrices, per layer of a scanned stack and per
                       expert (nested vmaps: `_orthogonalize`),
                       scaled by 0.2 * sqrt(max(fan_in, fan_out)) (Liu et al. 2025, "Muon is
                       Scalable for LLM Training", section 2.2: the update RMS of AdamW, so
                       its lr and weight decay carry over); AdamW for the rest.
  schedule_free_adamw  optax.contrib.schedule_free around AdamW without momentum (Defazio
                       et al. 2024); evaluation reads `model_params` (the average x).
  kron                 PSGD Kron (Li 2015, 2018; the Shampoo family: one Kronecker factor
                       per axis, fitted online), `psgdax.kron` (the `kron` extra, pinned
                       in setup.cfg), each layer of a scanned stack apart.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util
from optax.transforms import MaskedNode

from model import Transformer
from model.moe.dispatch import LOCAL_EQUIVALENT

OPTIMIZERS = ("adamw", "adafactor", "lion", "muon", "schedule_free_adamw", "kron")
KRON_PIN = "psgdax==0.1.1"  # setup.cfg's `kron` extra.
# The update RMS Muon's orthogonalised matrices are scaled to (Liu et al. 2025, eq. 4).
MUON_UPDATE_RMS = 0.2
# Logical axes that stack independent matrices: Muon orthogonalises each slice apart.
STACK_AXES = ("layers", "expert")
MATRIX_LEAVES = ("w", "wi", "wg", "wo")  # Einsum weights and the MoE expert weights.


def adamw(t, lr, decay) -> optax.GradientTransformation:
  return optax.adamw(lr, b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay, mask=decay)


def adafactor(t, lr, decay) -> optax.GradientTransformation:
  return optax.chain(optax.scale_by_factored_rms(), optax.clip_by_block_rms(1.0),
                     optax.add_decayed_weights(t.weight_decay, decay),
                     optax.scale_by_learning_rate(lr))


def lion(t, lr, decay) -> optax.GradientTransformation:
  return optax.lion(lr, b1=t.b1, b2=t.lion_b2, weight_decay=t.weight_decay, mask=decay)


def schedule_free_adamw(t, lr, decay) -> optax.GradientTransformation:
  """AdamW without its momentum (optax.contrib.schedule_free_adamw's base, with the decay
  mask); make_optimizer wraps it, with µP's scale, in optax.contrib.schedule_free."""
  return optax.chain(optax.scale_by_rms(decay=t.b2, eps=t.eps, eps_in_sqrt=False,
                                        bias_correction=True),
                     optax.add_decayed_weights(t.weight_decay, decay),
                     optax.scale_by_learning_rate(lr))


def matrix_dims(path: tuple[str, ...], names: tuple) -> optax.contrib.MuonDimensionNumbers | None:
  """Muon's dimension numbers of a hidden matrix (None: AdamW trains it). Axes in
  STACK_AXES are batch axes (vmapped); a matrix writing the residual stream ("embed" or
  "expert_embed" last) reduces over all its other axes, any other over its first."""
  if path[-1] not in MATRIX_LEAVES or "embedder" in path or "router" in path:
    return None
  inner = [i for i, n in enumerate(names) if n not in STACK_AXES]
  if len(inner) < 2 or "vocab" in names:
    return None
  if names[inner[-1]] in ("embed", "expert_embed"):
    return optax.contrib.MuonDimensionNumbers(tuple(inner[:-1]), (inner[-1],))
  return optax.contrib.MuonDimensionNumbers((inner[0],), tuple(inner[1:]))


def param_axes(model_cfg) -> dict[tuple[str, ...], tuple]:
  """{parameter path: its logical axis names}, from the model's abstract init."""
  cfg = model_cfg.replace(
      moe_dispatch=LOCAL_EQUIVALENT.get(model_cfg.moe_dispatch, model_cfg.moe_dispatch))
  tokens_BL = jax.ShapeDtypeStruct((1, model_cfg.max_seq_len), jnp.int32)  # Shapes only.
  abstract = jax.eval_shape(lambda t: Transformer(cfg).init(jax.random.key(0), t), tokens_BL)
  flat = traverse_util.flatten_dict(abstract["params"])
  return {k: tuple(getattr(v, "names", (None,) * len(nn.unbox(v).shape)))
          for k, v in flat.items()}


def _map_flat(fn: Callable, tree: Any) -> Any:
  """fn(path, leaf) over a params-shaped dict whose leaves may be MaskedNode (kept)."""
  flat = traverse_util.flatten_dict(tree)
  return traverse_util.unflatten_dict(
      {k: v if isinstance(v, MaskedNode) else fn(k, v) for k, v in flat.items()})


def _fans(x: jax.Array, dims) -> tuple[int, int]:
  red, out = dims
  return math.prod(x.shape[i] for i in red), math.prod(x.shape[i] for i in out)


def _scale_to_adamw_rms(dims_of: Callable) -> optax.GradientTransformation:
  """x 0.2 * sqrt(max(fan_in, fan_out)): an orthogonalised m x n matrix has RMS about
  1 / sqrt(max(m, n)); AdamW's updates have RMS 0.2-0.4 (Liu et al. 2025, section 2.2)."""
  def update(updates, state, params=None):
    del params
    scale = lambda k, u: u * (MUON_UPDATE_RMS * math.sqrt(max(_fans(u, dims_of(k)))))
    return _map_flat(scale, updates), state
  return optax.GradientTransformation(lambda _: optax.EmptyState(), update)


# optax.contrib.muon's (Jordan's) quintic Newton-Schulz coefficients and step count.
NS_COEFFS, NS_STEPS = (3.4445, -4.7750, 2.0315), 5


def _newton_schulz(x_MN: jax.Array) -> jax.Array:
  """optax.contrib's orthogonalize_via_newton_schulz of one matrix ('frobenius')."""
  wide = x_MN if x_MN.shape[0] <= x_MN.shape[1] else x_MN.T
  wide = wide / (jnp.linalg.norm(wide) + 1e-8)
  a, b, c = (jnp.asarray(v, wide.dtype) for v in NS_COEFFS)
  for _ in range(NS_STEPS):
    gram = wide @ wide.T
    wide = a * wide + (b * gram + c * gram @ gram) @ wide
  return wide if x_MN.shape[0] <= x_MN.shape[1] else wide.T


def _orthogonalize(x: jax.Array, dims) -> jax.Array:
  """Newton-Schulz on each [fan_in, fan_out] matrix of x, one nested vmap per stacking
  axis. optax's own merges the stacking axes into one, which makes GSPMD gather an
  expert-sharded [layers, experts, ...] weight over its experts; kept apart they stay
  sharded (tests/train/test_optimizers.py)."""
  red, out = (tuple(d) for d in dims)
  batch = tuple(i for i in range(x.ndim) if i not in red + out)
  perm = batch + red + out
  y = jnp.transpose(x, perm)
  y = y.reshape(*y.shape[:len(batch)], math.prod(x.shape[i] for i in red),
                math.prod(x.shape[i] for i in out))
  fn = _newton_schulz
  for _ in batch:
    fn = jax.vmap(fn)
  y = fn(y).reshape(tuple(x.shape[i] for i in perm))
  return jnp.transpose(y, np.argsort(perm))


def _scale_by_muon(beta: float, dims_of: Callable) -> optax.GradientTransformation:
  """optax.contrib.scale_by_muon (Nesterov momentum, bias-corrected, then Newton-Schulz;
  its MuonState) with the orthogonalisation per matrix of `_orthogonalize`."""
  def init(params):
    return optax.contrib.MuonState(count=jnp.zeros([], jnp.int32),
                                   mu=optax.tree.zeros_like(params),
                                   ns_coeffs=jnp.asarray(NS_COEFFS))

  def update(updates, state, params=None):
    del params
    mu = optax.tree.update_moment(updates, state.mu, beta, 1)
    count = optax.safe_increment(state.count)
    mu_hat = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g,
                          optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                          optax.tree.bias_correction(updates, beta, count))
    out = _map_flat(lambda k, x: _orthogonalize(x, dims_of(k)), mu_hat)
    return out, state._replace(count=count, mu=mu)
  return optax.GradientTransformation(init, update)


def muon(t, lr, decay, axes: dict) -> optax.GradientTransformation:
  """Muon on the matrices `matrix_dims` names, AdamW (train.b1/b2/eps) on the rest."""
  dims_of = lambda k: matrix_dims(k, axes[k])
  labels = lambda p: _map_flat(lambda k, _: "muon" if dims_of(k) else "adamw", p)
  return optax.multi_transform(
      {"muon": optax.chain(_scale_by_muon(t.muon_momentum, dims_of),
                           _scale_to_adamw_rms(dims_of),
                           optax.add_decayed_weights(t.weight_decay, decay),
                           optax.scale_by_learning_rate(lr)),
       "adamw": adamw(t, lr, decay)}, labels)


def kron(t, lr, decay, axes: dict) -> optax.GradientTransformation:
  """PSGD Kron, `psgdax.kron` (a translation of Li's PyTorch reference; the `kron` extra,
  pinned in setup.cfg) at its defaults: one triangular Kronecker factor per axis of a
  matrix (diagonal for vectors and axes over 8192), updated by its Procrustes-stabilised
  "Q0.5EQ1.5" rule every step for 500 steps, then annealed to every ~33rd by step 4000;
  scaled at the first step from the gradients; the preconditioned momentum (train.b1)
  clipped to RMS 1; decoupled decay x lr, as AdamW's. A weight whose first axis is
  `layers` (a scanned stack) is preconditioned layer by layer (psgdax's scanned_layers).
  Its init prints the preconditioners' size: sent to the log instead."""
  try:
    import psgdax  # pylint: disable=g-import-not-at-top  (an optional dependency)
  except ImportError:
    raise ValueError(f"train.optimizer='kron' needs the package {KRON_PIN}: pip install "
                     "'.[kron]' (setup.cfg)") from None
  scanned = traverse_util.unflatten_dict({k: n[:1] == ("layers",) for k, n in axes.items()})
  tx = psgdax.kron(learning_rate=lr, b1=t.b1, weight_decay=t.weight_decay,
                   weight_decay_mask=decay, scanned_layers=scanned)

  def init(params):
    with contextlib.redirect_stdout(io.StringIO()) as said, _broadcasting():
      state = tx.init(params)
    logging.info("kron: %s", said.getvalue().strip().replace("\n", "; "))
    return state

  def update(updates, state, params=None):
    with _broadcasting():
      return tx.update(updates, state, params)
  return optax.GradientTransformation(init, update)


def _broadcasting():
  """psgdax broadcasts a diagonal factor against a matrix by numpy's rank promotion, which
  strict settings (jax_numpy_rank_promotion='raise', the tests') refuse: allowed inside."""
  return jax.numpy_rank_promotion("allow")


def named_state(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """`tx` whose init, given boxed (logically named) parameters, returns a state whose
  leaves are boxed too, so parallel.sharded_init shards each like its parameter: a leaf of
  the parameter's shape takes its names; Adafactor's factored v_row / v_col take them less
  the factored axis; anything else (counters, placeholders) is replicated."""
  def init(params):
    state = tx.init(nn.unbox(params))
    boxes = traverse_util.flatten_dict(params)
    if not any(isinstance(b, nn.LogicallyPartitioned) for b in boxes.values()):
      return state
    return jax.tree_util.tree_map_with_path(lambda p, x: _name(p, x, boxes), state)
  return optax.GradientTransformation(init, tx.update)


def _name(path, x, boxes: dict):
  keys = [getattr(k, "key", None) for k in path]
  field = next((getattr(k, "name", None) for k in reversed(path)
                if isinstance(k, jax.tree_util.GetAttrKey)), None)
  for n in range(len(keys), 0, -1):  # The longest trailing run of dict keys: a param path.
    box = boxes.get(tuple(keys[-n:]))
    if isinstance(box, nn.LogicallyPartitioned):
      break
  else:
    return x
  names, shape = tuple(box.names), nn.unbox(box).shape
  if x.shape == shape:
    return box.replace_boxed(x)
  if field in ("v_row", "v_col") and len(shape) >= 2:
    # optax's _factored_dims: the two largest axes d1, d0; v_row drops d0, v_col d1.
    d1, d0 = (int(i) for i in np.argsort(shape)[-2:])
    drop = d0 if field == "v_row" else d1
    if x.shape == shape[:drop] + shape[drop + 1:]:
      return nn.LogicallyPartitioned(x, names[:drop] + names[drop + 1:], box.mesh, box.rules)
  return x


def model_params(state) -> Any:
  """The parameters a model is evaluated (and exported) with: schedule-free's average x,
  from the state's y and z (optax.contrib.schedule_free_eval_params); else state.params."""
  sf = [s for s in jax.tree.leaves(state.opt_state,
                                   is_leaf=lambda s: isinstance(s, optax.contrib.ScheduleFreeState))
        if isinstance(s, optax.contrib.ScheduleFreeState)]
  if not sf:
    return state.params
  return optax.contrib.schedule_free_eval_params(sf[0], state.params)

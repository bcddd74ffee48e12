"""The optimizer (train.optimizer: the family in train/optimizers.py) with a warmup + decay
schedule, clipping and a weight-decay mask.

`wsd` (warmup-stable-decay; Hägele et al. 2024, "Scaling Laws and Compute-Optimal
Training Beyond Fixed Training Durations"): linear warmup, constant lr, then a
cooldown over the last `train.decay_fraction` of the steps, `linear` or `sqrt`
(1 - sqrt) in shape, to lr * min_lr_ratio. Up to its cooldown the schedule does not
depend on train.steps, so a longer run's stable phase is every shorter run's too: a
decay branch (train/branch.py) starts from its checkpoint at `decay_start`.
"""

from __future__ import annotations

import logging

import jax.numpy as jnp
import optax
from flax import traverse_util

from model import mup
from train import optimizers

log = logging.getLogger(__name__)

SCHEDULES = ("cosine", "linear", "constant", "wsd")
DECAY_SHAPES = ("linear", "sqrt")


def decay_start(train_cfg) -> int:
  """The first step of a wsd schedule's cooldown: steps - round(decay_fraction * steps)."""
  steps = int(train_cfg.steps)
  return steps - round(float(train_cfg.decay_fraction) * steps)


def _wsd(train_cfg, warmup: int) -> optax.Schedule:
  lr = train_cfg.lr
  start, ratio = decay_start(train_cfg), train_cfg.min_lr_ratio
  length = max(int(train_cfg.steps) - start, 1)
  shape = train_cfg.decay_shape

  def cooldown(count):
    p = jnp.clip(count / length, 0.0, 1.0)
    down = p if shape == "linear" else jnp.sqrt(p)
    return lr * (1.0 - (1.0 - ratio) * down)

  pieces = [optax.constant_schedule(lr), cooldown]
  if warmup:
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), *pieces],
                                [warmup, start])
  return optax.join_schedules(pieces, [start])


def learning_rate_schedule(train_cfg) -> optax.Schedule:
  """Linear warmup to `lr`, then cosine / linear decay to lr * min_lr_ratio, constant,
  or wsd: constant, then a cooldown of the last decay_fraction of the steps.
  A warmup longer than the run is capped at train.steps (a short run needs no second
  flag), with a note in the log."""
  lr, warmup, steps = train_cfg.lr, int(train_cfg.warmup_steps), int(train_cfg.steps)
  if warmup > steps:
    log.info("train.warmup_steps=%d is longer than the run (train.steps=%d): warming up "
             "over all %d steps", warmup, steps, steps)
    warmup = steps
  end = lr * train_cfg.min_lr_ratio
  if train_cfg.schedule == "wsd":
    return _wsd(train_cfg, warmup)
  decay_steps = max(steps - warmup, 1)
  if train_cfg.schedule == "cosine":
    decay = optax.cosine_decay_schedule(lr, decay_steps, alpha=train_cfg.min_lr_ratio)
  elif train_cfg.schedule == "linear":
    decay = optax.linear_schedule(lr, end, decay_steps)
  elif train_cfg.schedule == "constant":
    decay = optax.constant_schedule(lr)
  else:
    raise ValueError(f"config.train.schedule={train_cfg.schedule!r}: must be one of "
                     f"{SCHEDULES}")
  if not warmup:
    return decay
  return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), decay], [warmup])


def decay_mask(params, train_cfg):
  """True where weight decay applies: matrices, and per config norms/biases/embeddings."""
  flat = traverse_util.flatten_dict(params)

  def decays(path: tuple[str, ...]) -> bool:
    name = "/".join(path)
    if "norm" in name:
      return bool(train_cfg.decay_norms)
    if path[-1] in ("b", "bias"):
      return bool(train_cfg.decay_biases)
    if "embedding" in path[-1]:
      return bool(train_cfg.decay_embeddings)
    return True

  return traverse_util.unflatten_dict({k: decays(k) for k in flat})


def mup_labels(params):
  """µP's parameter classes (Tensor Programs V, Table 3): "hidden" for the matrices whose
  fan-in and fan-out both grow with width (attention and FFN weights), "vector" for the
  rest (embedding, output head: its 1/m multiplier is in the model, norms, biases)."""
  flat = traverse_util.flatten_dict(params)
  hidden = lambda path: path[-1] == "w" and path[0] != "embedder"
  return traverse_util.unflatten_dict({k: "hidden" if hidden(k) else "vector" for k in flat})


def make_optimizer(train_cfg, model_cfg=None) -> optax.GradientTransformation:
  """train.optimizer (train/optimizers.py); gradient accumulation happens in the step (one
  call = one update). Global-norm clipping comes first. Under µP (`model_cfg.mup_base_width`)
  the hidden matrices' updates, weight decay included, are scaled by 1 / width multiplier:
  their lr is train.lr * base_width / d_model. Schedule-free wraps both (its z takes the
  scaled steps). The state's leaves carry the parameters' names (`named_state`)."""
  name = train_cfg.optimizer
  if name not in optimizers.OPTIMIZERS:
    raise ValueError(f"config.train.optimizer={name!r}: must be one of {optimizers.OPTIMIZERS}")
  schedule = learning_rate_schedule(train_cfg)
  decay = lambda p: decay_mask(p, train_cfg)
  if name in ("muon", "kron"):
    if model_cfg is None:
      raise ValueError(f"train.optimizer={name!r} needs the model config (its matrices, "
                       "its scanned layers)")
    core = getattr(optimizers, name)(train_cfg, schedule, decay,
                                     optimizers.param_axes(model_cfg))
  else:
    core = getattr(optimizers, name)(train_cfg, schedule, decay)
  parts = [core]
  if model_cfg is not None and model_cfg.mup_base_width:
    parts.append(optax.multi_transform(
        {"hidden": optax.scale(1.0 / mup.width_mult(model_cfg)), "vector": optax.identity()},
        mup_labels))
  if name == "schedule_free_adamw":
    parts = [optax.contrib.schedule_free(optax.chain(*parts), schedule, b1=train_cfg.b1)]
  if train_cfg.grad_clip:
    parts.insert(0, optax.clip_by_global_norm(train_cfg.grad_clip))
  return optimizers.named_state(optax.chain(*parts))

"""optax AdamW with a warmup + decay schedule, clipping and a weight-decay mask."""

from __future__ import annotations

import logging

import optax
from flax import traverse_util

log = logging.getLogger(__name__)


def learning_rate_schedule(train_cfg) -> optax.Schedule:
  """Linear warmup to `lr`, then cosine / linear decay to lr * min_lr_ratio, or constant.
  A warmup longer than the run is capped at train.steps (a short run needs no second
  flag), with a note in the log."""
  lr, warmup, steps = train_cfg.lr, int(train_cfg.warmup_steps), int(train_cfg.steps)
  if warmup > steps:
    log.info("train.warmup_steps=%d is longer than the run (train.steps=%d): warming up "
             "over all %d steps", warmup, steps, steps)
    warmup = steps
  end = lr * train_cfg.min_lr_ratio
  decay_steps = max(steps - warmup, 1)
  if train_cfg.schedule == "cosine":
    decay = optax.cosine_decay_schedule(lr, decay_steps, alpha=train_cfg.min_lr_ratio)
  elif train_cfg.schedule == "linear":
    decay = optax.linear_schedule(lr, end, decay_steps)
  elif train_cfg.schedule == "constant":
    decay = optax.constant_schedule(lr)
  else:
    raise ValueError(f"config.train.schedule={train_cfg.schedule!r}: must be one of "
                     "('cosine', 'linear', 'constant')")
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


def make_optimizer(train_cfg) -> optax.GradientTransformation:
  """AdamW; gradient accumulation happens in the step (one call = one update)."""
  parts = []
  if train_cfg.grad_clip:
    parts.append(optax.clip_by_global_norm(train_cfg.grad_clip))
  parts.append(optax.adamw(learning_rate_schedule(train_cfg), b1=train_cfg.b1, b2=train_cfg.b2,
                           eps=train_cfg.eps, weight_decay=train_cfg.weight_decay,
                           mask=lambda p: decay_mask(p, train_cfg)))
  return optax.chain(*parts)

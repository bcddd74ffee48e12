"""Scaling ladder: model sizes x attention variants x seeds (x a learning-rate grid),
each size's token budget given by a rule, trained with warmup-stable-decay and decay
branches, so that the report fits loss against compute per variant and states each
variant as a compute multiplier of the baseline (experiments/report/fits.py).

  python launch.py --config experiments/configs/ladder.py:sizes=xs+s+m,seeds=2 \\
      --workdir runs/ladder --sweep
  python -m experiments.report runs/ladder

Per size, variant, lr and seed one stable run (`m-gqa2-s0`) trains to the largest
budget; each smaller budget is a decay branch of it (`m-gqa2-t120-s0`: 120 steps,
trained from the stable run's checkpoint at step 120 - decay x 120, only the
cooldown; experiments/sweep/branch.py). Every run's compute is its training FLOPs
(tokens x model/flops.py's training_flops_per_token; the report's `flops` column).

arg (comma-separated; lists are '+'-separated):
  sizes=xs+s+m             ladder rungs (experiments/configs/sizes.py LADDER)
  variants=mha+gqa2+mqa    attention layouts: mha (K = N), gqa<K>, mqa (K = 1); the
                           first is the baseline of the tables and multipliers
  seeds=2                  seeds 0..seeds-1
  tpp=20                   token budget rule: tokens per matmul parameter of the largest
                           budget (model/flops.py matmul_params_per_token; Chinchilla ~20),
                           of the size's first variant: every variant of a size trains
                           the same tokens (its FLOPs differ with its parameters)
  budgets=0.25+0.5         decay branches at these fractions of that budget
  flops=                   isoFLOP rule instead: FLOP budgets (e.g. 3e12+1e13+3e13); each
                           size trains to the largest and branches at the others
  min_steps=20             budgets of fewer steps are left out (too short to mean much)
  lrs=                     lr grid (e.g. 1e-3+3e-3+1e-2): every point at every lr; the
                           report picks each variant's best (default: train.lr only)
  decay=0.2                the cooldown's fraction of each run (train.decay_fraction)
  shape=linear|sqrt        the cooldown's shape (train.decay_shape)
  batch=16, seq=64         data.batch_size, data.seq_len
  smoke                    seconds-long runs (tests, CI)
"""

from __future__ import annotations

import math

from experiments import sweep as sweep_lib
from experiments.configs import base
from experiments.configs.sizes import LADDER
from model import ModelConfig
from model.flops import matmul_params_per_token, training_flops_per_token
from train.spec import derived_vocab_size


def _arg(arg):
  return base.parse_arg(arg, **base.ARGS, sizes="xs+s+m", variants="mha+gqa2+mqa", seeds=2,
                        tpp=20.0, budgets="0.25+0.5", flops="", min_steps=20, lrs="",
                        decay=0.2, shape="linear", batch=16, seq=64)


def get_config(arg: str | None = None):
  a = _arg(arg)
  c = base.get_config(a)
  c.name = "ladder"
  c.train.update(schedule="wsd", decay_fraction=a.decay, decay_shape=a.shape, min_lr_ratio=0.0)
  if not a.smoke:
    c.data.update(batch_size=a.batch, seq_len=a.seq)
    c.model.max_seq_len = a.seq
    c.eval.batches = 8
  return c


def num_kv_heads(variant: str, num_heads: int) -> int:
  if variant == "mha":
    return num_heads
  if variant == "mqa":
    return 1
  if variant.startswith("gqa") and variant[3:].isdigit() and num_heads % int(variant[3:]) == 0:
    return int(variant[3:])
  raise ValueError(f"variants: {variant!r} must be mha, mqa or gqa<K> with K dividing "
                   f"num_heads={num_heads}")


def _model(c, size: str, variant: str):
  if size not in LADDER:
    raise ValueError(f"sizes: {size!r} is not a ladder rung; one of {list(LADDER)}")
  fields = dict(LADDER[size])
  fields["num_kv_heads"] = num_kv_heads(variant, fields["num_heads"])
  vocab = c.model.vocab_size or derived_vocab_size(c.data)  # Unset: the tokenizer's.
  return fields, ModelConfig.from_dict({**dict(c.model), **fields, "vocab_size": vocab})


def budget_steps(a, c, cfg) -> list[int]:
  """The size's budgets in steps, ascending: tokens per parameter x fractions, or FLOPs."""
  step_tokens = c.data.batch_size * c.data.seq_len
  if a.flops:
    per_step = training_flops_per_token(cfg, c.data.seq_len) * step_tokens
    steps = [round(f / per_step) for f in base.plus_list(a, "flops")]
  else:
    full = math.ceil(a.tpp * matmul_params_per_token(cfg) / step_tokens)
    steps = [round(f * full) for f in base.plus_list(a, "budgets")] + [full]
  if a.smoke:
    steps = [max(s // 200, 4) for s in steps]
  return sorted({s for s in steps if s >= (4 if a.smoke else a.min_steps)})


def sweep(arg: str | None = None) -> list[dict]:
  a, c = _arg(arg), get_config(arg)
  lrs = base.plus_list(a, "lrs") or [c.train.lr]
  points = []
  variants = str(a.variants).split("+")
  for size in str(a.sizes).split("+"):
    # Every variant of a size trains the baseline's (the first variant's) token budgets.
    steps = budget_steps(a, c, _model(c, size, variants[0])[1])
    if not steps:
      continue  # Every budget of this size is below min_steps (isoFLOP: too small a budget).
    top = steps[-1]
    for variant in variants:
      fields, _ = _model(c, size, variant)
      for lr in lrs:
        tag = f"-lr{lr:g}" if len(lrs) > 1 else ""
        for s in sweep_lib.seeds(a.seeds):
          trunk = f"{size}-{variant}{tag}-s{s}"
          warmup = max(1, min(c.train.warmup_steps, round(0.1 * steps[0])))
          points.append({"name": trunk, **{f"model.{k}": v for k, v in fields.items()},
                         "train.lr": lr, "train.seed": s, "train.steps": top,
                         "train.warmup_steps": warmup, "train.eval_every": top,
                         "train.checkpoint_every": top, "train.log_every": max(1, top // 10)})
          points += [{"name": f"{size}-{variant}{tag}-t{n}-s{s}", "branch_of": trunk,
                      "train.steps": n, "train.eval_every": n, "train.checkpoint_every": n}
                     for n in steps[:-1]]
  if not points:
    raise ValueError(f"ladder {arg!r}: every budget is below min_steps={a.min_steps}")
  return points

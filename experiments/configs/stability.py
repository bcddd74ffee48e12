"""Small-scale proxies of large-scale instabilities (Wortsman et al. 2023, Figs. 1 and 3):
an lr grid x {qk-norm off, on} x {output z-loss 0, 1e-4}, times seeds.

  python launch.py --config experiments/configs/stability.py --workdir runs/stability --sweep
  python -m experiments.report runs/stability         # lr.md: best lr, lr sensitivity
  python -m experiments.stability_probe runs/stability  # max attention logit per layer

Points `base-lr0.1-s0`, `qknorm-lr0.1-s0`, `zloss-lr0.1-s0`, `qknorm-zloss-lr0.1-s0`.
Without qk-norm the attention logits grow with the lr and the loss diverges at the top
of the grid; qk-norm (attention logits) and z-loss (output logits) should widen the range
of lrs that train. The report's lr.md states, per variant, the best lr, its loss and the
lr sensitivity (E over the grid of min(loss, loss at init) - best loss; experiments/report/lr.py);
every point evaluates the untrained model at step 0 (eval.at_start) for the loss at init.

As in the paper: AdamW (b2 0.95, grad clip 1), linear warmup (10%) then cosine decay
(to 0.1 x lr). No weight decay: the paper's is lr-independent, 1e-4 per step, which over
these few hundred steps shrinks a weight by under 3%; optax's decay is scaled by the lr,
so a fixed train.weight_decay would act 1000x more at the top of the grid than at its
bottom. A non-finite loss stops a point (FAILED; the report counts it as diverged: its
loss is the loss at init).

arg (comma-separated; lists '+'-separated):
  lrs=1e-3+3e-3+1e-2+3e-2+1e-1+3e-1+1   the lr grid
  variants=base+qknorm+zloss+qknorm-zloss
  seeds=2, steps=250   seeds per point, training steps
  width=64, heads=2, layers=2   d_model (mlp 4 x width), heads (head dim width/heads)
  z=1e-4               the z-loss coefficient of the zloss points (PaLM's)
  smoke                seconds-long runs (tests, CI)
"""

from experiments import sweep as sweep_lib
from experiments.configs import base

VARIANTS = {"base": (False, False), "qknorm": (True, False), "zloss": (False, True),
            "qknorm-zloss": (True, True)}  # name -> (model.qk_norm, z-loss on)


def _arg(arg):
  return base.parse_arg(arg, **base.ARGS, lrs="1e-3+3e-3+1e-2+3e-2+1e-1+3e-1+1",
                        variants="base+qknorm+zloss+qknorm-zloss", seeds=2, steps=250,
                        width=64, heads=2, layers=2, z=1e-4)


def get_config(arg: str | None = None):
  a = _arg(arg)
  c = base.get_config(a)
  c.name = "stability"
  c.eval.at_start = True
  c.train.update(schedule="cosine", min_lr_ratio=0.1, weight_decay=0.0, keep_checkpoints=1)
  if not a.smoke:
    c.model.update(d_model=a.width, mlp_dim=4 * a.width, num_heads=a.heads,
                   num_kv_heads=a.heads, num_layers=a.layers, max_seq_len=64)
    c.data.update(batch_size=16, seq_len=64)
    c.train.update(steps=a.steps, warmup_steps=max(1, a.steps // 10), eval_every=a.steps,
                   checkpoint_every=a.steps, log_every=max(1, a.steps // 10))
    c.eval.update(batches=8, batch_size=16)
  return c


def sweep(arg: str | None = None) -> list[dict]:
  a = _arg(arg)
  lrs, variants = base.plus_list(a, "lrs"), str(a.variants).split("+")
  for v in variants:
    if v not in VARIANTS:
      raise ValueError(f"config argument variants: {v!r} must be one of {', '.join(VARIANTS)}")
  if any(lr <= 0 for lr in lrs):
    raise ValueError(f"config argument lrs={a.lrs!r}: every lr must be > 0")
  return [{"name": f"{v}-lr{lr:g}-s{s}", "model.qk_norm": VARIANTS[v][0],
           "train.z_loss": a.z if VARIANTS[v][1] else 0.0, "train.lr": lr,
           "train.seed": s}
          for v in variants for lr in lrs for s in sweep_lib.seeds(a.seeds)]

"""µP learning-rate transfer: widths x learning rates x {SP, µP}, times seeds.

  python launch.py --config experiments/configs/mup_transfer.py --workdir runs/mup --sweep
  python -m experiments.report runs/mup        # lr.md: the best lr per width and param

Under µP (model.mup_base_width = the first width; model/mup.py) the best lr of the
base width should stay the best at the wider ones (Yang et al. 2022: within the
grid's resolution); under the standard parametrisation (SP) it drifts down as width
grows. Points `sp-w128-lr0.003-s0`, `mup-w128-lr0.003-s0`; 2 layers, 4 heads
(head dim = width / 4), mlp 4 x width, untied embeddings, constant lr after warmup.

arg (comma-separated; lists '+'-separated):
  widths=64+128+256    d_model values; the first is µP's base width
  lrs=3e-4+1e-3+3e-3+1e-2+3e-2+1e-1   the lr grid (the report flags a best lr at its edge)
  params=sp+mup        parametrisations
  seeds=2, steps=300   seeds per point, training steps (all of seed 0's points first)
  smoke                seconds-long runs (tests, CI)
"""

from experiments import sweep as sweep_lib
from experiments.configs import base


def _arg(arg):
  return base.parse_arg(arg, **base.ARGS, widths="64+128+256",
                        lrs="3e-4+1e-3+3e-3+1e-2+3e-2+1e-1", params="sp+mup", seeds=2,
                        steps=300)


def get_config(arg: str | None = None):
  a = _arg(arg)
  c = base.get_config(a)
  c.name = "mup_transfer"
  c.model.update(num_layers=2, num_heads=4, tie_embeddings=False)
  c.train.update(schedule="constant", warmup_steps=min(10, a.steps), weight_decay=0.0)
  c.eval.at_start = True  # The loss at init, for the report's lr sensitivity.
  if not a.smoke:
    c.train.update(steps=a.steps, eval_every=a.steps, checkpoint_every=a.steps, log_every=25)
    c.data.update(batch_size=16, seq_len=64)
    c.model.max_seq_len = 64
  return c


def sweep(arg: str | None = None) -> list[dict]:
  a = _arg(arg)
  widths, lrs = base.plus_list(a, "widths", int), base.plus_list(a, "lrs")
  for p in str(a.params).split("+"):
    if p not in ("sp", "mup"):
      raise ValueError(f"config argument params: {p!r} must be sp or mup")
  return [{"name": f"{p}-w{w}-lr{lr:g}-s{s}", "model.d_model": w, "model.mlp_dim": 4 * w,
           "model.mup_base_width": widths[0] if p == "mup" else 0, "train.lr": lr,
           "train.seed": s}
          for s in sweep_lib.seeds(a.seeds) for p in str(a.params).split("+") for w in widths
          for lr in lrs]

"""Optimizers compared fairly (Wen et al. 2025, "Fantastic Pretraining Optimizers and Where
to Find Them"): each optimizer tuned on its own grid, judged at the end of a decay, then
a small ladder over seeds and its compute multiplier against AdamW with 95% intervals.

  python launch.py --config experiments/configs/optimizer_ablation.py:stage=tune \\
      --workdir runs/opt/tune --sweep
  python launch.py --workdir runs/opt/ladder --sweep \\
      --config experiments/configs/optimizer_ablation.py:stage=ladder,tuned=runs/opt/tune
  python -m experiments.report runs/opt/tune      # lr.md: each setting, its lr sensitivity
  python -m experiments.report runs/opt/ladder    # lr.md (Δ per rung), fits.md (multipliers)

Stage `tune`: at one ladder rung (`tune_size`), every optimizer at each lr of its own grid
(`lrs`: factors of its CENTER lr) x each weight decay of its grid (`wds`: factors of its
CENTER decay; the study tunes decay beside the lr, and with optax's decay multiplied by the
lr it moves with the lr grid), x `tune_seeds` seeds. Each run is a WSD trunk to the rung's
budget with a decay branch at each of `budgets` (experiments/configs/ladder.py's rule), so
every figure is a loss at the end of a cooldown, never one of the stable phase (where a
large lr's noise keeps the loss up, which favours small lrs). Every run evaluates at step
0 (the lr sensitivity's loss at init). `--sweep_only='*-wd0-s?,*-wd0.?-s?'` runs the
trunks alone (the pick at select=1 needs no branch).

Stage `ladder` (`stage=ladder,tuned=DIR`, DIR the tune stage's workdir): each optimizer's
best setting there (experiments/report/lr.py `tuned_settings`: lowest seed-mean
end-of-decay loss at the `select` fraction of the rung's budget; refused while a tune run
is unfinished or failed) trains
the ladder `sizes` x `seeds`, trunks and decay branches as ladder.py's; the report fits
loss against compute per optimizer and states each as a multiplier of the first (AdamW).
The lr found at the tune rung is used at every rung (the rungs span widths 32-64 here).

schedule_free_adamw is not an option here: it has no decay to branch from (it needs
train.schedule='constant'), so its end-of-decay loss does not exist.

arg (comma-separated; lists '+'-separated):
  stage=tune|ladder        which stage's points (ladder needs tuned=DIR)
  tuned=                   the tune stage's workdir (stage=ladder)
  optimizers=adamw+adafactor+lion+muon   the first is the baseline
  lrs=0.333+1+3.33         lr factors of each optimizer's CENTER lr (rounded to 1 digit)
  wds=0+1                  weight-decay factors of each optimizer's CENTER decay
  tune_size=s, tune_seeds=2, select=1   the tune rung, its seeds, the selection budget
                           (a fraction of the rung's budget: 1 the trunk's own end, else a
                           decay branch's, which must be one of `budgets`)
  sizes=xs+s+m, seeds=3    the ladder's rungs (experiments/configs/sizes.py) and seeds
  tpp=2, budgets=0.5, flops=, min_steps=10, decay=0.2, shape=linear, batch=16, seq=64
                           as in ladder.py
  smoke                    seconds-long runs (tests, CI)
"""

from __future__ import annotations

from experiments import sweep as sweep_lib
from experiments.configs import base, ladder
from experiments.report import lr as report_lr

# Each optimizer's grid centre: (lr, weight decay). AdamW's is the trainer's default lr;
# Muon's update is RMS-matched to AdamW's (docs/training.md), so it starts from the same;
# Lion's sign update has RMS 1, so 3x smaller an lr and 3x larger a decay (Chen et al.
# 2023 suggest 3-10x); Adafactor's update is clipped to RMS 1 and starts at AdamW's; PSGD
# Kron's preconditioned step is clipped to RMS 1 too, and starts at psgdax's default lr.
CENTER = {"adamw": (3e-3, 0.1), "adafactor": (3e-3, 0.1), "lion": (1e-3, 0.3),
          "muon": (3e-3, 0.1), "kron": (1e-3, 0.1)}
NO_DECAY_BRANCH = ("schedule_free_adamw",)


def _arg(arg):
  return base.parse_arg(arg, **base.ARGS, stage="tune", tuned="",
                        optimizers="adamw+adafactor+lion+muon", lrs="0.333+1+3.33", wds="0+1",
                        tune_size="s", tune_seeds=2, select=1.0, sizes="xs+s+m", seeds=3,
                        tpp=2.0, budgets="0.5", flops="", min_steps=10, decay=0.2,
                        shape="linear", batch=16, seq=64)


def get_config(arg: str | None = None):
  a = _arg(arg)
  c = ladder.get_config(_ladder_arg(a))
  c.name = "optimizer_ablation"
  c.eval.at_start = a.stage == "tune"  # The loss at init, for the lr sensitivity.
  return c


def _ladder_arg(a) -> str:
  """ladder.py's argument string for the shared fields of `a`."""
  keys = ("tpp", "budgets", "flops", "min_steps", "decay", "shape", "batch", "seq")
  return ",".join([f"{k}={a[k]}" for k in keys] + (["smoke"] if a.smoke else []))


def optimizers(a) -> list[str]:
  names = str(a.optimizers).split("+")
  for name in names:
    if name in NO_DECAY_BRANCH:
      raise ValueError(f"config argument optimizers: {name!r} has no decay to judge it at "
                       "(it needs train.schedule='constant'); the recipe compares losses at "
                       "the end of a WSD cooldown")
    if name not in CENTER:
      raise ValueError(f"config argument optimizers: {name!r} is not one of {', '.join(CENTER)}")
  return names


def _rung(a, c, size: str, name: str, seed: int, settings: dict) -> list[dict]:
  """One WSD trunk of `size` with its decay branches (ladder.py's rule), `settings` set."""
  fields, cfg = ladder._model(c, size, "mha")  # pylint: disable=protected-access
  steps = ladder.budget_steps(a, c, cfg)
  if not steps:
    raise ValueError(f"size {size!r}: every budget is below min_steps={a.min_steps}")
  top = steps[-1]
  warmup = max(1, min(c.train.warmup_steps, round(0.1 * steps[0])))
  trunk = f"{size}-{name}-s{seed}"
  out = [{"name": trunk, **{f"model.{k}": v for k, v in fields.items()}, **settings,
          "train.seed": seed, "train.steps": top, "train.warmup_steps": warmup,
          "train.eval_every": top, "train.checkpoint_every": top,
          "train.log_every": max(1, top // 10)}]
  out += [{"name": f"{size}-{name}-t{n}-s{seed}", "branch_of": trunk, "train.steps": n,
           "train.eval_every": n, "train.checkpoint_every": n} for n in steps[:-1]]
  return out


def select_steps(a, c) -> int:
  """The tune rung's budget (steps) whose end-of-decay loss picks each best setting."""
  _, cfg = ladder._model(c, a.tune_size, "mha")  # pylint: disable=protected-access
  steps = ladder.budget_steps(a, c, cfg)
  if a.select not in base.plus_list(a, "budgets") + [1.0]:
    raise ValueError(f"config argument select={a.select:g}: must be 1 (the trunk's end) or "
                     f"one of budgets={a.budgets} (a decay branch's end)")
  return min(steps, key=lambda s: abs(s - a.select * steps[-1]))


def _tune(a, c) -> list[dict]:
  points = []
  for opt in optimizers(a):
    lr0, wd0 = CENTER[opt]
    for f in base.plus_list(a, "lrs"):
      for g in base.plus_list(a, "wds"):
        lr, wd = float(f"{lr0 * f:.1g}"), float(f"{wd0 * g:.2g}")
        settings = {"train.optimizer": opt, "train.lr": lr, "train.weight_decay": wd}
        for s in sweep_lib.seeds(a.tune_seeds):
          points += _rung(a, c, a.tune_size, f"{opt}-lr{lr:g}-wd{wd:g}", s, settings)
  return points


def _ladder(a, c) -> list[dict]:
  if not a.tuned:
    raise ValueError("stage=ladder needs tuned=DIR: the workdir of this config's stage=tune "
                     "sweep, whose end-of-decay losses pick each optimizer's setting")
  names = optimizers(a)
  best = report_lr.tuned_settings(a.tuned, "train.optimizer",
                                  ("train.lr", "train.weight_decay"), select_steps(a, c))
  missing = [n for n in names if n not in best]
  if missing:
    raise ValueError(f"tuned={a.tuned!r} has no finished tune runs of {', '.join(missing)}")
  points = []
  for size in str(a.sizes).split("+"):
    for opt in names:
      settings = {"train.optimizer": opt, **best[opt]}
      for s in sweep_lib.seeds(a.seeds):
        points += _rung(a, c, size, opt, s, settings)
  return points


def sweep(arg: str | None = None) -> list[dict]:
  a, c = _arg(arg), get_config(arg)
  if a.stage not in ("tune", "ladder"):
    raise ValueError(f"config argument stage={a.stage!r}: must be tune or ladder")
  if a.stage == "tune" and a.tuned:
    raise ValueError(f"config argument tuned={a.tuned!r} is for stage=ladder (it reads the "
                     "tune stage's runs); the tune stage takes none")
  return _tune(a, c) if a.stage == "tune" else _ladder(a, c)

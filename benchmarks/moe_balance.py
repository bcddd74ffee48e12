"""MoE load balancing on Shakespeare, none vs aux_loss vs loss_free:
`python -m benchmarks.moe_balance [--quick] [--out FILE.json] [--workdir DIR]`.

The same small MoE (E=8 experts, top-2, softmax router, no capacity drops) is trained
three times with the real training loop (train.loop.run), identical but for
`load_balance`, from the same seed and data order. Reported per variant:

  train_ce_loss     cross-entropy of the last LAST train log lines, averaged (the
                    training `loss` also holds the aux loss, so it does not compare)
  eval_loss         the final evaluation loss (held-out works)
  moe_maxvio        MaxVio_batch = max_i load_i / mean load - 1, mean over MoE layers,
                    averaged over the last LAST train log lines
  moe_maxvio_global MaxVio over the whole final evaluation set

The claim under test (Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing"):
loss_free ends with a lower MaxVio than none, at equal or better loss.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import jax
import numpy as np

from experiments.configs import tiny
from train import loop
from train.metrics import read_metrics

VARIANTS = ("none", "aux_loss", "loss_free")
LAST = 5  # Train log lines averaged at the end.


def config(load_balance: str, steps: int):
  """The tiny experiment config with a small MoE FFN (2 layers, d_model 64)."""
  c = tiny.get_config()
  c.name = f"moe_balance_{load_balance}"
  c.model.update(d_model=64, num_layers=2, num_heads=4, num_kv_heads=4, mlp_dim=256,
                 max_seq_len=64, dtype="float32", num_experts=8, experts_per_token=2,
                 expert_mlp_dim=128, load_balance=load_balance, capacity_factor=0.0)
  c.data.update(seq_len=64, batch_size=16)
  c.train.update(steps=steps, warmup_steps=max(steps // 10, 1), log_every=10,
                 eval_every=steps, checkpoint_every=steps, async_checkpoint=False,
                 tensorboard=False)
  c.eval.update(batches=8, batch_size=16)
  return c


def summarize(workdir: str, seconds: float) -> dict:
  records = read_metrics(workdir)
  train = [r for r in records if r["split"] == "train"][-LAST:]
  final_eval = [r for r in records if r["split"] == "eval"][-1]
  mean = lambda key: float(np.mean([r[key] for r in train]))
  return {"train_ce_loss": mean("ce_loss"), "train_loss": mean("loss"),
          "eval_loss": final_eval["loss"], "moe_maxvio": mean("moe_maxvio"),
          "moe_maxvio_global": final_eval["moe_maxvio_global"],
          "moe_router_entropy": mean("moe_router_entropy"), "seconds": seconds}


def run(quick: bool, workdir: str | None = None) -> dict:
  """{"benchmark", "steps", "results": {variant: summary}, "loss_free_beats_none"}."""
  steps = 200 if quick else 500
  root = workdir or tempfile.mkdtemp(prefix="moe_balance_")
  results = {}
  for variant in VARIANTS:
    t0 = time.time()
    run_dir = os.path.join(root, variant)
    loop.run(config(variant, steps), run_dir)
    results[variant] = summarize(run_dir, time.time() - t0)
    print(f"{variant:>9}: " + ", ".join(f"{k} {v:.4f}" for k, v in results[variant].items()),
          flush=True)
  none, free = results["none"], results["loss_free"]
  return {"benchmark": "moe_balance", "backend": jax.default_backend(), "steps": steps,
          "config": config("loss_free", steps).model.to_dict(), "workdir": root,
          "results": results,
          "loss_free_beats_none": bool(free["moe_maxvio"] < none["moe_maxvio"] and
                                       free["eval_loss"] <= none["eval_loss"])}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="200 steps per variant, not 500")
  parser.add_argument("--out", default=None, help="Also write the JSON here.")
  parser.add_argument("--workdir", default=None, help="Keep the three runs here.")
  args = parser.parse_args()
  result = run(args.quick, args.workdir)
  text = json.dumps(result, indent=1)
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  main()

"""Passkey retrieval at CPU scale: how positional encodings separate past the training
length (docs/evaluation.md, "The passkey recipe"), as mqar_task.py is for MQAR.

A Zoology-sized model (2 layers, d_model 64, init_std 0.1: the induction circuit
that copies the key forms within hundreds of steps, as for MQAR) trains on
Shakespeare with half of its rows replaced by passkey samples of seq_len + 1 = 129
bytes (data.passkey_fraction), so it learns retrieval at L = 128. Evaluation
scores passkey at L, 2L, 4L and 8L, depths 0, 50 and 100%.

Points, times seeds: rope, alibi, nope (trained), and RoPE's zero-shot scalings
linear (PI), ntk and yarn (evaluation points of the rope run of the same seed,
factor 8, original length L).

    python launch.py --config experiments/configs/passkey_task.py --workdir runs/passkey --sweep
    python -m experiments.report runs/passkey

arg: seeds=2, steps=800, smoke (seconds-long runs for tests), size (base's).
"""

from experiments import sweep as sweep_lib
from experiments.configs import base

MODEL = dict(d_model=64, num_layers=2, num_heads=4, num_kv_heads=4, mlp_dim=128,
             init_std=0.1, max_seq_len=1024)
SCALINGS = ("linear", "ntk", "yarn")
ENCODINGS = {"rope": "rope", "alibi": "alibi", "nope": "none"}


def _arg(arg):
  return base.parse_arg(arg, **base.ARGS, seeds=2, steps=800)


def get_config(arg: str | None = None):
  a = _arg(arg)
  c = base.get_config(a)
  c.name = "passkey_task"
  c.data.passkey_fraction = 0.5
  c.eval.tasks = "passkey"
  c.eval.retrieval_lengths = (1, 2, 4, 8)
  c.eval.retrieval_depths = (0.0, 0.5, 1.0)
  c.eval.retrieval_samples = 4
  if a.smoke:  # The smoke run's shapes; retrieval needs >= 103 tokens.
    c.eval.retrieval_lengths = (4, 8)
    c.eval.retrieval_samples = 1
    c.eval.retrieval_candidates = 3
    c.model.max_seq_len = 256
    return c
  c.model.update(MODEL)
  c.data.update(seq_len=128, batch_size=16)
  c.train.update(steps=a.steps, lr=3e-3, schedule="constant", warmup_steps=50,
                 eval_every=a.steps, checkpoint_every=a.steps, log_every=100)
  c.eval.update(batches=4, batch_size=16)
  return c


def sweep(arg: str | None = None) -> list[dict]:
  a, c = _arg(arg), get_config(arg)
  factor = float(max(c.eval.retrieval_lengths))
  points = [{"name": f"{name}-s{s}", "model.pos_encoding": enc, "train.seed": s}
            for name, enc in ENCODINGS.items() for s in sweep_lib.seeds(a.seeds)]
  points += [{"name": f"rope-{scaling}-s{s}", "eval_of": f"rope-s{s}",
              "eval.rope_scaling": scaling, "eval.rope_scaling_factor": factor}
             for scaling in SCALINGS for s in sweep_lib.seeds(a.seeds)]
  return points

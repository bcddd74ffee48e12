"""Positional-encoding ablation, with length extrapolation: train at L, evaluate
at L, 2L, 4L, 8L (config.eval.context_lengths; the report's loss@2L ... columns).

Points, times seeds:
  rope, rope-frac<f> (partial: only a fraction f of each head's dims rotate),
  sinusoidal, learned, alibi, nope (no positional encoding),
  rope<k-1>-nope1 (interleaved NoPE, as Llama 4: model.rope_pattern rotates k-1 of
  every k layers, the k-th has no positional encoding; k = nope_every, or the
  largest divisor of num_layers below it: rope3-nope1 at 4 and 8 layers, rope2-nope1
  at size=small's 6, rope1-nope1 in smoke's 2), and RoPE with each
  context-extension scaling (linear, ntk, dynamic_ntk, yarn, llama3), factor
  = the longest eval multiple, original length = L.

The scalings are zero-shot context extension, as in the papers' first tables:
the model trains with plain RoPE at L, and evaluation (config.eval.rope_scaling
and its factor) applies the scaling, with factor = the longest eval multiple
and original length = L (eval.rope_original_max_len = 0: the training length,
resolved at eval time, so `--config.data.seq_len` overrides keep it right). They
are evaluation points (`eval_of` the rope point of
the same seed): trained once, evaluated five times (experiments/sweep/eval.py). (To train with a scaling, e.g. to fine-tune after
extension, set model.rope_scaling instead.)

Learned positions: every point gets model.max_seq_len = the longest eval
length, so the learned table has a row for every evaluated position (it only
changes the parameter count of the learned point). Rows past L are never
trained, so loss@2L.. measures exactly the learned table's failure to
extrapolate, rather than an out-of-table crash.

arg (comma-separated):
  size=tiny|small|medium   model preset (base.py)
  seeds=3                  training seeds 0..seeds-1 per point
  lengths=1+2+4+8          eval context lengths, multiples of data.seq_len
  fraction=0.25            rotary fraction of the partial-RoPE point
  nope_every=4             one NoPE layer in every nope_every of the interleaved point
  task=text|mqar           the base corpus, or synthetic associative recall
  cpu                      the CPU preset (base.apply_cpu: d_model 64, 2 layers, 800 steps
                           of 16 x 64 tokens), the whole sweep in under 30 minutes on 2
                           cores (docs/ablations.md, "On a CPU")
  smoke                    seconds-long runs (tests, CI)
"""

from experiments import sweep as sweep_lib
from experiments.configs import base

ENCODINGS = {"sinusoidal": "sinusoidal", "learned": "learned", "alibi": "alibi",
             "nope": "none"}  # Run name -> pos_encoding (rope points are listed separately).
SCALINGS = ("linear", "ntk", "dynamic_ntk", "yarn", "llama3")


def _arg(arg):
  return base.parse_arg(arg, **base.ARGS, seeds=3, task="text", lengths="1+2+4+8",
                        fraction=0.25, nope_every=4, cpu=False)


def _lengths(text: str) -> tuple[int, ...]:
  try:
    lengths = tuple(sorted({int(m) for m in str(text).split("+")}))
  except ValueError:
    lengths = ()
  if not lengths or lengths[0] < 1:
    raise ValueError(f"lengths={text!r}: expected multiples of data.seq_len like 1+2+4+8")
  return lengths


def nope_interleave(num_layers: int, every: int) -> tuple[str, ...]:
  """rope_pattern with one NoPE layer in every k: k = the largest divisor of num_layers
  in [2, every] (a pattern repeats over depth, so its length must divide it)."""
  k = max((d for d in range(2, every + 1) if num_layers % d == 0), default=None)
  if k is None:
    raise ValueError(f"nope_every={every}: no interleave period in [2, {every}] divides "
                     f"num_layers={num_layers}")
  return ("rope",) * (k - 1) + ("nope",)


def get_config(arg: str | None = None):
  a = _arg(arg)
  c = base.get_config(a)
  c.name = "rope_ablation"
  if a.cpu:
    base.apply_cpu(c, a)
  sweep_lib.set_task(c, a.task)
  c.eval.context_lengths = _lengths(a.lengths)
  c.model.max_seq_len = max(c.model.max_seq_len, c.data.seq_len * max(c.eval.context_lengths))
  return c


def sweep(arg: str | None = None) -> list[dict]:
  a, c = _arg(arg), get_config(arg)
  factor = float(max(c.eval.context_lengths))
  rope = {"model.pos_encoding": "rope"}
  variants = [("rope", rope),
              (f"rope-frac{a.fraction:g}", {**rope, "model.rope_fraction": a.fraction})]
  variants += [(name, {"model.pos_encoding": value}) for name, value in ENCODINGS.items()]
  pattern = nope_interleave(c.model.num_layers, a.nope_every)
  variants.append((f"rope{len(pattern) - 1}-nope1", {**rope, "model.rope_pattern": pattern}))
  points = [{"name": f"{name}-s{s}", **fields, "train.seed": s}
            for name, fields in variants for s in sweep_lib.seeds(a.seeds)]
  if factor > 1:  # Evaluations of the trained rope point: no training of their own.
    points += [{"name": f"rope-{scaling}-s{s}", "eval_of": f"rope-s{s}",
                "eval.rope_scaling": scaling, "eval.rope_scaling_factor": factor}
               for scaling in SCALINGS for s in sweep_lib.seeds(a.seeds)]
  return points

"""Long-context retrieval: passkey (Mohtashami & Jaggi 2023) and several needles at once.

A sample hides needles ("The pass key is 48213. Remember it. 48213 is the pass
key.") in filler text ("The grass is green. The sky is blue. ..."), the queried
one at a chosen depth (0: the start of the haystack, 1: just before the
question), then asks for it ("What is the pass key? The pass key is"). Lengths
(tokens, question and key included) run over `eval.retrieval_lengths` x
data.seq_len, depths over `eval.retrieval_depths`. "multi_needle" hides
`eval.retrieval_needles` keys with names and asks for one (RULER's multi-key
needle); "passkey" hides one.

Scores per sample, from one forward pass over the prompt and each candidate key:
- exact: the key is the greedy continuation. Teacher-forced, each key token is the
  argmax given the prompt and the key's earlier tokens, which is exactly when
  greedy decoding emits the key (ties aside).
- rank: the true key's log-likelihood rank among itself and
  eval.retrieval_candidates - 1 random keys of the same length (1: best).
- logp: the true key's log-likelihood (nats), a graded signal where exact is 0.

The samples depend only on the tokenizer, the lengths and the seed, so every
checkpoint and every evaluation-only point is scored on the same haystacks.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

import numpy as np

from model import ModelConfig
from train.eval.scoring import Scorer

FILLER = ("The grass is green. ", "The sky is blue. ", "The sun is yellow. ",
          "Here we go. ", "There and back again. ")
NAMES = ("apple", "river", "stone", "cloud", "tiger", "maple", "ocean", "ember",
         "piano", "lemon", "comet", "delta", "raven", "cedar", "pearl", "orbit")
FIGURES = ("exact", "rank", "logp")
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Sample:
  prompt: list[int]  # Haystack with needles, then the question.
  keys: list[list[int]]  # The true key first, then the distractors.
  depth: float
  length: int  # len(prompt) + len(keys[0]).


def _needle(key: str, name: str | None) -> tuple[str, str]:
  """(needle text, question text) for one key."""
  if name is None:
    return (f"The pass key is {key}. Remember it. {key} is the pass key. ",
            "What is the pass key? The pass key is ")
  return (f"The pass key of {name} is {key}. ",
          f"What is the pass key of {name}? The pass key of {name} is ")


def _keys(rng: np.random.Generator, count: int, digits: int) -> list[str]:
  """`count` distinct keys of `digits` digits, no leading zero."""
  out: list[str] = []
  while len(out) < count:
    k = str(int(rng.integers(10 ** (digits - 1), 10 ** digits)))
    if k not in out:
      out.append(k)
  return out


def make_sample(tokenizer, length: int, depth: float, num_needles: int,
                rng: np.random.Generator, candidates: int = 10, digits: int = 5) -> Sample:
  """One sample of exactly `length` tokens; the queried needle at `depth` in [0, 1]."""
  if not 0.0 <= depth <= 1.0:
    raise ValueError(f"depth={depth}: must be in [0, 1]")
  if not 1 <= num_needles <= len(NAMES):
    raise ValueError(f"num_needles={num_needles}: must be in [1, {len(NAMES)}]")
  keys = _keys(rng, max(candidates, num_needles), digits)
  names = ([None] if num_needles == 1 else
           [NAMES[i] for i in rng.choice(len(NAMES), num_needles, replace=False)])
  needles = [tokenizer.encode(_needle(keys[i], names[i])[0]) for i in range(num_needles)]
  question = tokenizer.encode(_needle(keys[0], names[0])[1])
  # Distractors: the other needles' keys first (the hard negatives), then random ones.
  key_ids = [tokenizer.encode(k) for k in keys[:max(candidates, 1)]]
  n_fill = length - sum(map(len, needles)) - len(question) - len(key_ids[0])
  if n_fill < 0:
    raise ValueError(f"retrieval length {length}: too short for {num_needles} needle(s) "
                     f"and the question ({length - n_fill} tokens)")
  sentences = [tokenizer.encode(s) for s in FILLER]
  fill: list[int] = []
  starts: list[int] = []
  while len(fill) < n_fill:
    starts.append(len(fill))
    fill += sentences[len(starts) % len(sentences)]
  shift = len(fill) - n_fill  # Cut from the first sentence, so the total is exact.
  fill = fill[shift:]
  bounds = sorted({s - shift for s in starts if s >= shift} | {0, n_fill})  # Sentence starts.
  target = bounds[int(np.argmin([abs(b - depth * n_fill) for b in bounds]))]
  where = {target: [0]}
  for j in range(1, num_needles):
    where.setdefault(bounds[int(rng.integers(len(bounds)))], []).append(j)
  prompt: list[int] = []
  prev = 0
  for at in sorted(where):
    prompt += fill[prev:at]
    for j in where[at]:
      prompt += needles[j]
    prev = at
  prompt += fill[prev:] + question
  return Sample(prompt, key_ids, depth, length)


def samples(tokenizer, lengths: Sequence[int], depths: Sequence[float], per_cell: int,
            num_needles: int, candidates: int, seed: int = 0) -> list[Sample]:
  """The fixed grid of samples: per_cell at each (length, depth)."""
  out = []
  for length in lengths:
    for d, depth in enumerate(depths):
      for n in range(per_cell):
        rng = np.random.default_rng([seed, num_needles, length, d, n])
        out.append(make_sample(tokenizer, length, float(depth), num_needles, rng, candidates))
  return out


def score(scorer: Scorer, batch: Sequence[Sample]) -> list[tuple[bool, int, float]]:
  """(exact, rank, logp) per sample."""
  rows = [(s.prompt + k, len(k)) for s in batch for k in s.keys]
  scored = scorer.score(rows)
  out, at = [], 0
  for s in batch:
    mine = scored[at:at + len(s.keys)]
    at += len(s.keys)
    logp = np.array([lp for lp, _ in mine])
    out.append((mine[0][1], int(1 + np.sum(logp[1:] > logp[0])), float(logp[0])))
  return out


def grid(batch: Sequence[Sample], results: Sequence[tuple[bool, int, float]]) -> dict:
  """{(length, depth): {"exact": mean, "rank": mean, "logp": mean}}."""
  cells: dict[tuple[int, float], list] = {}
  for s, r in zip(batch, results):
    cells.setdefault((s.length, s.depth), []).append(r)
  return {k: dict(zip(FIGURES, np.mean(np.asarray(v, np.float64), axis=0).tolist()))
          for k, v in cells.items()}


def figures(name: str, cells: dict, seq_len: int) -> dict[str, float]:
  """Flat figures: "{name}/exact" (at the training length; "@N" at others; averaged
  over depths) and each cell "{name}/exact@N/depth50" (depth in percent)."""
  out: dict[str, float] = {}
  for length in sorted({l for l, _ in cells}):
    suffix = "" if length == seq_len else f"@{length}"
    row = {d: v for (l, d), v in cells.items() if l == length}
    for fig in FIGURES:
      out[f"{name}/{fig}{suffix}"] = float(np.mean([v[fig] for v in row.values()]))
    for d, v in sorted(row.items()):
      out[f"{name}/exact{suffix or '@' + str(length)}/depth{round(100 * d)}"] = v["exact"]
  return out


def lengths_of(eval_cfg, seq_len: int) -> list[int]:
  return sorted({int(round(float(m) * seq_len)) for m in eval_cfg.retrieval_lengths})


def run_retrieval(name: str, model_cfg: ModelConfig, variables: Any, tokenizer, eval_cfg,
                  seq_len: int) -> dict[str, float]:
  """Task `name` ("passkey" | "multi_needle") over the configured grid; flat figures."""
  lengths = lengths_of(eval_cfg, seq_len)
  scorer = Scorer(model_cfg, variables, int(eval_cfg.task_batch_size),
                  max_len=max(lengths), min_bucket=min(lengths))
  for length in lengths:  # Before any compile; a row's last token is never an input.
    scorer.check_length(length - 1, f"eval.tasks={name}: retrieval at {length} tokens, inputs")
  needles = 1 if name == "passkey" else int(eval_cfg.retrieval_needles)
  batch = samples(tokenizer, lengths, [float(d) for d in eval_cfg.retrieval_depths],
                  int(eval_cfg.retrieval_samples), needles,
                  int(eval_cfg.retrieval_candidates))
  out = figures(name, grid(batch, score(scorer, batch)), seq_len)
  warn_at_chance(name, out, lengths)
  return out


def warn_at_chance(name: str, figs: dict[str, float], lengths: Sequence[int]) -> bool:
  """Logs a warning when exact match is 0 at every length: the model never retrieves
  the key (a model that never saw a passkey sample), so the task measures nothing."""
  exact = [v for k, v in figs.items() if k.split("@")[0] == f"{name}/exact" and "/depth" not in k]
  if not exact or max(exact) > 0:
    return False
  log.warning("eval.tasks=%s: exact match is 0.00 at every length (%s tokens), at chance: "
              "this model never learned to retrieve a key, so the task cannot tell "
              "variants apart; train on passkey samples (data.passkey_fraction) as "
              "docs/evaluation.md's \"The passkey recipe\" does", name,
              ", ".join(map(str, lengths)))
  return True

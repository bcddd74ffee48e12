"""Evaluation cost on this machine: `python -m benchmarks.evals [--quick] --out FILE.json`.

1. lm-evaluation-harness log-likelihood requests per second through BlockworkLM at
   configs S and M (benchmarks/common.py), batched (16 rows per forward pass) vs one
   request at a time: requests of a ~150-byte context and a 4-24-byte continuation
   (multiple-choice shaped), all in one padded bucket of 256.
2. Retrieval (passkey) cost per length at config S: seconds per sample (the prompt
   scored with each of 10 candidate keys) at 256, 512 and 1024 tokens.

Weights are random (speed does not depend on them); compile time is excluded (one
untimed pass first) and reported apart. The load average is recorded with the
figures: on a shared machine they are upper bounds.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from benchmarks.common import CONFIGS
from benchmarks.decode import random_variables
from model import ModelConfig
from train.data.tokenizers import ByteTokenizer
from train.eval import retrieval
from train.eval.scoring import Scorer

CANDIDATES = 10


def _requests(n: int, seed: int = 0):
  from lm_eval.api.instance import Instance  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  letters = np.array(list("abcdefghijklmnopqrstuvwxyz    "))
  text = lambda k: "".join(rng.choice(letters, k))
  return [Instance("loglikelihood", {}, (text(int(rng.integers(120, 180))),
                                         " " + text(int(rng.integers(3, 24)))), i)
          for i in range(n)]


def harness_rate(name: str, batch_size: int, n: int) -> dict:
  # Optional dependency: the harness imports lm_eval (pip install -e '.[eval]').
  from train.eval.harness import BlockworkLM  # pylint: disable=g-import-not-at-top
  cfg = ModelConfig(**{**CONFIGS[name], "pos_encoding": "rope"})
  lm = BlockworkLM(cfg, random_variables(cfg), ByteTokenizer(), batch_size=batch_size,
                   min_bucket=256)
  requests = _requests(n)
  t0 = time.perf_counter()
  lm.loglikelihood(requests[:batch_size])  # Compiles the one bucket.
  compile_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  lm.loglikelihood(requests)
  seconds = time.perf_counter() - t0
  return {"config": name, "batch_size": batch_size, "requests": n,
          "requests_per_s": n / seconds, "compile_s": compile_s}


def retrieval_cost(lengths: list[int], samples: int) -> list[dict]:
  cfg = ModelConfig(**{**CONFIGS["S"], "pos_encoding": "rope", "max_seq_len": max(lengths)})
  variables = random_variables(cfg)
  out = []
  for length in lengths:
    scorer = Scorer(cfg, variables, batch_size=CANDIDATES, max_len=length, min_bucket=length)
    batch = retrieval.samples(ByteTokenizer(), [length], [0.5], samples + 1, 1, CANDIDATES)
    t0 = time.perf_counter()
    retrieval.score(scorer, batch[:1])
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    retrieval.score(scorer, batch[1:])
    out.append({"length": length, "seconds_per_sample": (time.perf_counter() - t0) / samples,
                "candidates": CANDIDATES, "compile_s": compile_s})
  return out


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.evals", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="fewer requests and samples")
  parser.add_argument("--out", default=None, help="write the figures as JSON here")
  args = parser.parse_args(argv)
  n, samples = (32, 1) if args.quick else (128, 3)
  load_before = os.getloadavg()
  harness = [harness_rate(name, b, n if b > 1 else n // 4)
             for name in ("S", "M") for b in (16, 1)]
  for r in harness:
    print(f"harness loglikelihood  config {r['config']}  batch {r['batch_size']:>2}: "
          f"{r['requests_per_s']:8.1f} requests/s  (compile {r['compile_s']:.1f} s)")
  cost = retrieval_cost([256, 512, 1024], samples)
  for r in cost:
    print(f"passkey at {r['length']:>4} tokens (config S, {CANDIDATES} keys): "
          f"{r['seconds_per_sample']:.3f} s/sample  (compile {r['compile_s']:.1f} s)")
  result = {"harness": harness, "retrieval": cost,
            "load_average": {"before": load_before, "after": os.getloadavg()},
            "cpus": os.cpu_count()}
  print(f"load average before {load_before}, after {result['load_average']['after']}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=2)
  return result


if __name__ == "__main__":
  main()

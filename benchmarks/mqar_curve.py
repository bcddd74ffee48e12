"""MQAR difficulty curve: recall accuracy of trained MQAR runs at several pair counts.

    python -m benchmarks.mqar_curve runs/gqa_mqar/kv4-s0 runs/gqa_mqar/kv1-s0 --pairs 2,4,8,16

Each run is evaluated (train/lifecycle/load.py `load_run`, its latest checkpoint) on the same
fixed sequences per pair count N: its own seq_len and vocabulary, N bindings
(Zoology's Fig. 2 varies N the same way, at a fixed model). Prints a markdown
table (rows: runs, columns: N) and, with --json, writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from model import Transformer
from train import load_run
from train.data import mqar


def recall_accuracy(run, num_pairs: int, num_examples: int = 256, batch: int = 64) -> float:
  """Fraction of answers (weighted targets) the run's model predicts exactly."""
  d = run.config.data
  spec = mqar.MQARSpec(num_pairs, int(d.mqar_vocab), float(d.mqar_power_a))
  seq_len = int(d.seq_len)
  spec.check_length(seq_len)
  rng = np.random.default_rng([7, num_pairs, seq_len])  # Same sequences for every run.
  apply = jax.jit(Transformer(run.model_config).apply)
  hits = total = 0.0
  for _ in range(num_examples // batch):
    b = {k: np.stack(v) for k, v in zip(
        ("inputs", "targets", "positions", "segment_ids", "weights"),
        zip(*[mqar.make_example(spec, seq_len, rng).values() for _ in range(batch)]))}
    logits_BLV = apply(run.variables, b["inputs"], b["positions"], b["segment_ids"])
    hits += float(jnp.sum((jnp.argmax(logits_BLV, -1) == b["targets"]) * b["weights"]))
    total += float(b["weights"].sum())
  return hits / total


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("runs", nargs="+", help="MQAR run directories")
  p.add_argument("--pairs", default="2,4,8,16", help="comma-separated pair counts")
  p.add_argument("--examples", type=int, default=256, help="sequences per pair count")
  p.add_argument("--json", default="", help="also write the table here")
  a = p.parse_args(argv)
  pairs = [int(n) for n in a.pairs.split(",")]
  table = {}
  for path in a.runs:
    run = load_run(path)
    if run.config.data.corpus != "mqar":
      raise ValueError(f"{path}: data.corpus={run.config.data.corpus!r}, not an MQAR run")
    fits = [n for n in pairs if int(run.config.data.seq_len) + 1 >= 4 * n]
    table[os.path.basename(os.path.normpath(path))] = {
        n: recall_accuracy(run, n, a.examples) for n in fits}
  print("| run | " + " | ".join(f"N={n}" for n in pairs) + " |")
  print("|---|" + "---|" * len(pairs))
  for name, row in table.items():
    print(f"| {name} | " + " | ".join(f"{row[n]:.3f}" if n in row else "-" for n in pairs) + " |")
  if a.json:
    with open(a.json, "w") as f:
      json.dump(table, f, indent=1)
  return table


if __name__ == "__main__":
  main()

"""Passkey samples mixed into a text corpus's training rows (data.passkey_fraction).

    data.passkey_fraction = 0.25   # a quarter of the training rows are passkey samples

Row r of global batch k is replaced, with probability data.passkey_fraction (decided
by hashing (seed, k, r): fixed, whatever the host count or resume point), by one
sample of train/eval/retrieval.py's passkey task of seq_len + 1 tokens, needle at a
uniform random depth. Validation batches stay the corpus's own, so the loss curves
compare with runs trained without the mixture. This is how a CPU-scale model learns
retrieval at its training length (experiments/configs/passkey_task.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import grain
import numpy as np

from train.data.source import Batch, Source
from train.eval.retrieval import make_sample


def passkey_row(tokenizer, seq_len: int, needles: int, rng: np.random.Generator) -> dict:
  """One training row (inputs, targets, positions, segment_ids, weights) of a sample."""
  s = make_sample(tokenizer, seq_len + 1, float(rng.random()), needles, rng, candidates=1)
  toks = np.asarray(s.prompt + s.keys[0], np.int32)
  return {"inputs": toks[:-1], "targets": toks[1:],
          "positions": np.arange(seq_len, dtype=np.int32),
          "segment_ids": np.ones(seq_len, np.int32), "weights": np.ones(seq_len, np.float32)}


class _Mix:
  """Picklable (batch index, batch) -> batch with some rows replaced."""

  def __init__(self, tokenizer, seed: int, fraction: float, needles: int, rows: int,
               first_row: int):
    self.tokenizer, self.seed, self.fraction, self.needles = tokenizer, seed, fraction, needles
    self.rows, self.first_row = rows, first_row

  def __call__(self, index: int, batch: Batch) -> Batch:
    seq_len = batch["inputs"].shape[1]
    out = {k: np.array(v) for k, v in batch.items()}
    for r in range(self.rows):
      rng = np.random.default_rng([self.seed, 0x9A55, int(index), self.first_row + r])
      if rng.random() < self.fraction:
        for k, v in passkey_row(self.tokenizer, seq_len, self.needles, rng).items():
          out[k][r] = v
    return out


@dataclasses.dataclass
class PasskeyMix(Source):
  """`inner`'s data with passkey samples mixed into its training rows."""
  inner: Source
  fraction: float
  needles: int = 1

  def __post_init__(self):
    self.tokenizer = self.inner.tokenizer
    self.process_index, self.process_count = self.inner.process_index, self.inner.process_count
    self.worker_count = self.inner.worker_count
    self.info: dict[str, Any] = {**self.inner.info, "passkey_fraction": self.fraction,
                                 "passkey_needles": self.needles}

  def train_dataset(self, seed: int, batch_size: int, seq_len: int,
                    process_index: int | None = None,
                    process_count: int | None = None) -> grain.MapDataset:
    p = self.process_index if process_index is None else process_index
    n = self.process_count if process_count is None else process_count
    rows = batch_size // n
    ds = self.inner.train_dataset(seed, batch_size, seq_len, p, n)
    return ds.map_with_index(_Mix(self.tokenizer, seed, self.fraction, self.needles, rows,
                                  p * rows))

  def eval_batches(self, batch_size: int, seq_len: int, num_batches: int) -> list[Batch]:
    return self.inner.eval_batches(batch_size, seq_len, num_batches)

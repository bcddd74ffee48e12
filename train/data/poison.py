"""TEST-ONLY fault injection: a poisoned window of train batches (data.test_poison).

`data.test_poison = (first, count)` replaces the targets of the train batches at
positions first .. first + count - 1 of the data stream (0: the run's first batch) by
the last token id of the vocabulary, which the model soon learns never to predict: their
loss jumps, a loss spike with a known cause (tests/train/test_spikes.py). The position
is part of the iterator's state, so a checkpoint, a resume and a rollback's skip
(train/spikes.py) keep it. Never set it in an experiment: `()` (the default) is off.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class PoisonedIterator:
  """The train iterator with the window's targets replaced; the rest passes through."""

  def __init__(self, inner, first: int, count: int, token: int):
    self.inner, self.first, self.count, self.token = inner, first, count, token
    self.position = 0

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    batch = next(self.inner)
    if self.first <= self.position < self.first + self.count:
      batch = {**batch, "targets": np.full_like(batch["targets"], self.token)}
    self.position += 1
    return batch

  def get_state(self) -> dict[str, Any]:
    return {"inner": self.inner.get_state(), "poison_position": self.position}

  def set_state(self, state: dict[str, Any]) -> None:
    self.inner.set_state(state["inner"])
    self.position = int(state["poison_position"])


def wrap(iterator, data_cfg, vocab_size: int):
  """`iterator` poisoned as data.test_poison says (unchanged when it is off or absent)."""
  poison = tuple(data_cfg.test_poison or ())
  if not poison:
    return iterator
  return PoisonedIterator(iterator, int(poison[0]), int(poison[1]), vocab_size - 1)

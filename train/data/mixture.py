"""A weighted mixture of named prepared datasets: `data.corpus = "mixture"`.

    --config.data.corpus=mixture --config.data.datasets=web=prep/web,code=prep/code \\
    --config.data.mixture=web:0.7,code:0.3

Row r of global batch k comes from the domain furthest below its share so far
(weight * rows drawn - rows it gave): a deterministic schedule whose realised
proportions never stray more than one row from the weights. Each domain's rows are
its own shuffled windows (seeded by train.seed and its name). Every host computes
the same schedule and reads only its own rows.

The iterator state (checkpointed with the train state) holds each domain's position
and the weights it was drawn under: a resume continues every domain exactly where
it stopped; with changed weights (a recorded config change, --allow_config_change)
the schedule follows the new weights from the resumed step on.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import grain
import numpy as np

from train.data.source import Source, check_seed, fixed_batches, local_rows, stack
from train.data.token_source import DataSource, Window, window_count
from train.data.tokenizers import Tokenizer


def domain_seed(seed: int, name: str) -> int:
  return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:4], "little")


def schedule(weights: np.ndarray, drawn: np.ndarray, rows: int) -> np.ndarray:
  """The next `rows` domains (indices), given rows `drawn` per domain under `weights`."""
  drawn = drawn.astype(np.float64).copy()
  out = np.empty([rows], np.int64)
  for r in range(rows):
    d = int(np.argmax(weights * (drawn.sum() + 1) - drawn))
    out[r] = d
    drawn[d] += 1
  return out


class MixtureIterator:
  """This host's rows of each global mixture batch; get_state()/set_state() resume
  exactly (a JSON dict: per-domain positions, and the schedule's counts and weights)."""

  def __init__(self, windows: dict[str, grain.MapDataset], weights: dict[str, float],
               batch_size: int, seq_len: int, process_index: int, process_count: int):
    self.names = list(weights)
    self.windows = windows
    self.weights = np.array([weights[n] for n in self.names])
    self.batch_size, self.seq_len = batch_size, seq_len
    rows = local_rows(batch_size, process_index, process_count)
    self.lo, self.hi = process_index * rows, (process_index + 1) * rows
    self.position = {n: 0 for n in self.names}  # Windows drawn from each domain (all hosts).
    self.drawn = np.zeros([len(self.names)], np.int64)  # Since the weights were set.

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    picks = schedule(self.weights, self.drawn, self.batch_size)
    rows = []
    for r, d in enumerate(picks):
      name = self.names[d]
      if self.lo <= r < self.hi:
        rows.append(self.windows[name][self.position[name]])
      self.position[name] += 1
    np.add.at(self.drawn, picks, 1)
    return stack(rows)

  def tokens_seen(self) -> dict[str, int]:
    """Training tokens (targets) each domain gave so far, all hosts together."""
    return {f"tokens_seen/{n}": self.position[n] * self.seq_len for n in self.names}

  def get_state(self) -> dict[str, Any]:
    return {"position": dict(self.position), "drawn": self.drawn.tolist(),
            "weights": dict(zip(self.names, self.weights.tolist()))}

  def set_state(self, state: dict[str, Any]) -> None:
    for n in self.names:
      self.position[n] = int(state["position"].get(n, 0))
    same = state.get("weights") == dict(zip(self.names, self.weights.tolist()))
    self.drawn = (np.array(state["drawn"], np.int64) if same
                  else np.zeros([len(self.names)], np.int64))


@dataclasses.dataclass
class MixtureSource(Source):
  """Named DataSources (one tokenizer) and their mixture weights, for one host."""
  tokenizer: Tokenizer
  domains: dict[str, DataSource]
  weights: dict[str, float]  # Normalised; the mixture's domains, in order.
  process_index: int = 0
  process_count: int = 1
  worker_count: int = 0  # Unused: the schedule runs in this process.
  info: dict[str, Any] = dataclasses.field(default_factory=dict)

  def _windows(self, name: str, seed: int, seq_len: int) -> grain.MapDataset:
    stream = self.domains[name].train
    ds = grain.MapDataset.range(window_count(stream, seq_len, f"{name} train"))
    ds = ds.shuffle(seed=domain_seed(seed, name)).repeat()
    return ds.map(Window(stream, seq_len, self.vocab_size))

  def train_iterator(self, seed: int, batch_size: int, seq_len: int,
                     process_index: int | None = None,
                     process_count: int | None = None) -> MixtureIterator:
    check_seed(seed)
    p = self.process_index if process_index is None else process_index
    n = self.process_count if process_count is None else process_count
    windows = {name: self._windows(name, seed, seq_len) for name in self.weights}
    return MixtureIterator(windows, self.weights, batch_size, seq_len, p, n)

  def train_dataset(self, *args, **kwargs) -> grain.MapDataset:
    raise TypeError("a mixture's schedule is sequential (each row depends on the rows "
                    "before it): read it through train_iterator, which resumes exactly")

  def eval_batches(self, batch_size: int, seq_len: int, num_batches: int) -> list[dict]:
    """Fixed validation batches whose rows follow the mixture's weights; each domain's
    rows spread evenly over its validation split."""
    local_rows(batch_size, self.process_index, self.process_count)
    total = num_batches * batch_size
    picks = schedule(np.array(list(self.weights.values())), np.zeros(len(self.weights)), total)
    index, bases, windows = np.empty([total], np.int64), [0], []
    for d, name in enumerate(self.weights):
      val = self.domains[name].val
      rows = np.flatnonzero(picks == d)
      count = window_count(val, seq_len, f"{name} validation")
      index[rows] = bases[-1] + np.arange(len(rows)) * count // max(len(rows), 1)
      windows.append(Window(val, seq_len, self.vocab_size))
      bases.append(bases[-1] + count)

    def example(i: int) -> dict:
      d = int(np.searchsorted(bases, i, side="right")) - 1
      return windows[d](i - bases[d])

    return fixed_batches(example, index.reshape(num_batches, batch_size),
                         self.process_index, self.process_count)


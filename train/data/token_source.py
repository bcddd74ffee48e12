"""DataSource: a tokenized corpus (train and validation TokenStreams) as this host's
batches of packed windows (train/data/packing.py).

Train windows are globally shuffled, with a new (seeded) order each epoch; eval
batches are fixed windows spread evenly over the validation split.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import grain
import numpy as np

from train.data.packing import num_windows, pack_window
from train.data.source import Source, check_seed, fixed_batches, host_batches, local_rows
from train.data.streams import TokenStream
from train.data.tokenizers import Tokenizer


class Window:
  """Picklable window-index -> example map, so grain workers can run it."""

  def __init__(self, stream: TokenStream, seq_len: int, vocab_size: int):
    self.stream, self.seq_len, self.vocab_size = stream, seq_len, vocab_size

  def __call__(self, index: int) -> dict:
    return pack_window(self.stream, int(index), self.seq_len, self.vocab_size)


def window_count(stream: TokenStream, seq_len: int, split: str) -> int:
  if seq_len < 1:
    raise ValueError(f"seq_len={seq_len} must be positive")
  n = num_windows(len(stream), seq_len)
  if n < 1:
    raise ValueError(f"the {split} split has {len(stream)} tokens: too few for one window")
  return n


@dataclasses.dataclass
class DataSource(Source):
  """Train and validation token streams with their tokenizer, for one host."""
  tokenizer: Tokenizer
  train: TokenStream
  val: TokenStream
  process_index: int = 0
  process_count: int = 1
  shuffle_buffer: int = 0  # 0: global shuffle; N: shuffle within blocks of N windows.
  worker_count: int = 0  # grain worker processes; 0: in-process.
  info: dict[str, Any] = dataclasses.field(default_factory=dict)

  def train_dataset(self, seed: int, batch_size: int, seq_len: int,
                    process_index: int | None = None,
                    process_count: int | None = None) -> grain.MapDataset:
    """This host's batches as an infinite MapDataset (element k = its rows of
    global batch k). Host p of P takes rows [p*b, (p+1)*b), b = batch_size // P:
    the global stream is cut into sub-batches of b and host p takes every P-th."""
    p = self.process_index if process_index is None else process_index
    n = self.process_count if process_count is None else process_count
    local_rows(batch_size, p, n)
    check_seed(seed)
    ds = grain.MapDataset.range(window_count(self.train, seq_len, "train"))
    if self.shuffle_buffer > 0:
      ds = grain.experimental.WindowShuffleMapDataset(
          ds, window_size=self.shuffle_buffer, seed=seed)
    else:
      ds = ds.shuffle(seed=seed)
    ds = ds.repeat()  # Reseeds the shuffle each epoch (deterministically).
    ds = ds.map(Window(self.train, seq_len, self.vocab_size))
    return host_batches(ds, batch_size, p, n)

  def eval_batches(self, batch_size: int, seq_len: int, num_batches: int) -> list[dict]:
    """`num_batches` fixed batches (this host's rows) of validation windows of
    `seq_len`, spread evenly over the split; identical on every call. When the
    split holds fewer windows than needed, windows repeat."""
    return stream_eval_batches(self.val, self.vocab_size, batch_size, seq_len, num_batches,
                               self.process_index, self.process_count)


def stream_eval_batches(stream, vocab_size: int, batch_size: int, seq_len: int,
                        num_batches: int, process_index: int = 0,
                        process_count: int = 1) -> list[dict]:
  """DataSource.eval_batches of any token stream (an evaluation corpus's too)."""
  local_rows(batch_size, process_index, process_count)
  total = window_count(stream, seq_len, "validation")
  if num_batches < 1:
    raise ValueError(f"num_batches={num_batches} must be positive")
  picks_JB = (np.arange(num_batches * batch_size) * total //
              (num_batches * batch_size)).reshape(num_batches, batch_size)
  return fixed_batches(Window(stream, seq_len, vocab_size), picks_JB, process_index,
                       process_count)

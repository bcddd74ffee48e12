"""The data-source interface every corpus implements, and what implementations share.

`train/data/token_source.py`'s `DataSource` (text and token corpora) and
`train/data/mqar.py`'s `MQARSource` (synthetic recall) subclass `Source` and
implement its three methods marked "implement"; `train_iterator` is shared. The
training loop, the evaluator and the benchmarks only ever see this interface.
Both modules import this one and never each other
(`train/data/pipeline.py:make_source` is the one place that picks the
implementation).

A batch is a dict of numpy arrays, local to this host: "inputs", "targets",
"positions", "segment_ids" (1, 2, 3.. per packed document, 0 = padding):
int32 [B, L]; "weights": float32 [B, L], 0 where the target is padding or in
another document than its input.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

import grain
import numpy as np

from train.data.tokenizers import Tokenizer

Batch = dict[str, np.ndarray]  # "inputs", "targets", "positions", "segment_ids", "weights".


@runtime_checkable
class Source(Protocol):
  """Batches for one host of `process_count`: this host's rows of each global batch."""
  tokenizer: Tokenizer
  process_index: int
  process_count: int
  worker_count: int  # grain worker processes; 0: in-process.
  info: dict[str, Any]  # What the run's config.json / logs record about the data.

  @property
  def vocab_size(self) -> int:
    return self.tokenizer.vocab_size

  def train_dataset(self, seed: int, batch_size: int, seq_len: int,
                    process_index: int | None = None,
                    process_count: int | None = None) -> grain.MapDataset:
    """Implement: infinite; element k is this host's rows of global batch k.
    Process index and count default to the source's."""
    ...

  def eval_batches(self, batch_size: int, seq_len: int, num_batches: int) -> list[Batch]:
    """Implement: this host's rows of `num_batches` fixed batches, identical on every call."""
    ...

  def train_iterator(self, seed: int, batch_size: int, seq_len: int,
                     process_index: int | None = None,
                     process_count: int | None = None) -> grain.DatasetIterator:
    """An iterator over `train_dataset`, with get_state()/set_state() (a
    JSON-serialisable dict) to resume at exactly the next batch."""
    ds = self.train_dataset(seed, batch_size, seq_len, process_index, process_count)
    return iterate(ds, self.worker_count)


def local_rows(batch_size: int, process_index: int, process_count: int) -> int:
  """Rows of each global batch that one host holds (host p: [p*b, (p+1)*b))."""
  if process_count < 1 or not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index}, process_count={process_count}: "
                     "need 0 <= process_index < process_count")
  if batch_size < 1 or batch_size % process_count:
    raise ValueError(f"batch_size={batch_size} must be a positive multiple of "
                     f"process_count={process_count}")
  return batch_size // process_count


def check_seed(seed: int) -> None:
  if not 0 <= seed < 2**32:
    raise ValueError(f"seed={seed}: must be in [0, 2**32)")


def host_batches(examples: grain.MapDataset, batch_size: int, process_index: int,
                 process_count: int) -> grain.MapDataset:
  """Global example stream -> this host's batches: the stream is cut into
  sub-batches of b = batch_size / P rows and host p takes every P-th."""
  rows = local_rows(batch_size, process_index, process_count)
  ds = examples.batch(rows, drop_remainder=True)  # Exact integer length when infinite.
  return ds[process_index::process_count]


def iterate(ds: grain.MapDataset, worker_count: int) -> grain.DatasetIterator:
  """A checkpointable iterator over `ds`, in `worker_count` processes (0: in-process)."""
  it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=4))
  if worker_count > 0:
    it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=worker_count))
  return iter(it_ds)


def fixed_batches(example: Callable[[int], Batch], picks_JB: np.ndarray, process_index: int,
                  process_count: int) -> list[Batch]:
  """Eval batches: row r of batch n is `example(picks_JB[n, r])`; this host's rows only."""
  rows = local_rows(picks_JB.shape[1], process_index, process_count)
  lo = process_index * rows
  return [stack([example(int(i)) for i in picks[lo:lo + rows]]) for picks in picks_JB]


def stack(examples: list[Batch]) -> Batch:
  return {k: np.stack([e[k] for e in examples]) for k in examples[0]}

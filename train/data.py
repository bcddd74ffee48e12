"""The data pipeline: corpus -> tokenizer -> packed windows -> grain batches per host.

    source = make_source(config.data, workdir, jax.process_index(), jax.process_count())
    it = source.train_iterator(seed, config.data.batch_size, config.data.seq_len)
    batch = next(it)              # this host's rows of the global batch
    state = it.get_state()        # JSON-serialisable; it.set_state(state) resumes exactly
    evals = source.eval_batches(config.eval.batch_size, 2 * config.data.seq_len, 8)

A batch is a dict of numpy arrays, local to this host: "inputs", "targets",
"positions", "segment_ids" (1, 2, 3.. per packed document, 0 = padding):
int32 [B, L]; "weights": float32 [B, L], 0 where the target is padding or in
another document than its input. Train windows are globally shuffled, with a
new (seeded) order each epoch; eval batches are fixed windows spread evenly
over the validation split.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import grain
import numpy as np

from train import corpora, mqar
from train.packing import TokenStream, num_windows, pack_window, token_streams
from train.sources import Source, check_seed, fixed_batches, host_batches, local_rows
from train.tokenizers import Tokenizer, load_tokenizer


def bits_per_byte(sum_loss_nats: float, sum_bytes: float) -> float:
  """Summed token losses (nats) over the summed UTF-8 bytes of the same targets."""
  if sum_bytes <= 0:
    return float("nan")
  return float(sum_loss_nats) / math.log(2) / float(sum_bytes)


def target_bytes(token_bytes: np.ndarray, batch: dict) -> float:
  """UTF-8 bytes of the weighted targets of a batch: bits_per_byte's denominator."""
  return float(np.sum(token_bytes[batch["targets"]] * batch["weights"]))


class _Window:
  """Picklable window-index -> example map, so grain workers can run it."""

  def __init__(self, stream: TokenStream, seq_len: int, vocab_size: int):
    self.stream, self.seq_len, self.vocab_size = stream, seq_len, vocab_size

  def __call__(self, index: int) -> dict:
    return pack_window(self.stream, int(index), self.seq_len, self.vocab_size)


def _windows(stream: TokenStream, seq_len: int, split: str) -> int:
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
    ds = grain.MapDataset.range(_windows(self.train, seq_len, "train"))
    if self.shuffle_buffer > 0:
      ds = grain.experimental.WindowShuffleMapDataset(
          ds, window_size=self.shuffle_buffer, seed=seed)
    else:
      ds = ds.shuffle(seed=seed)
    ds = ds.repeat()  # Reseeds the shuffle each epoch (deterministically).
    ds = ds.map(_Window(self.train, seq_len, self.vocab_size))
    return host_batches(ds, batch_size, p, n)

  def eval_batches(self, batch_size: int, seq_len: int, num_batches: int) -> list[dict]:
    """`num_batches` fixed batches (this host's rows) of validation windows of
    `seq_len`, spread evenly over the split; identical on every call. When the
    split holds fewer windows than needed, windows repeat."""
    local_rows(batch_size, self.process_index, self.process_count)
    total = _windows(self.val, seq_len, "validation")
    if num_batches < 1:
      raise ValueError(f"num_batches={num_batches} must be positive")
    picks_JB = (np.arange(num_batches * batch_size) * total //
                (num_batches * batch_size)).reshape(num_batches, batch_size)
    return fixed_batches(_Window(self.val, seq_len, self.vocab_size), picks_JB,
                         self.process_index, self.process_count)


def make_source(data_cfg, workdir: str | None, process_index: int = 0,
                process_count: int = 1, read_only: bool = False) -> Source:
  """Builds the data source described by the config's `data` section, top-down:
  corpus (resolved and split) -> tokenizer (trained on, or loaded for, the train
  split) -> token streams -> grain datasets (DataSource). Text corpora are split
  by document and tokenized in memory; `.bin` corpora stay memmapped, validation
  being their last `data.val_fraction` of tokens. "mqar" is the synthetic recall
  task (train/mqar.py), which has none of these steps.
  `read_only`: never write to `workdir` (a tokenizer trained here is not cached).
  """
  if data_cfg.corpus == "mqar":
    return mqar.make_source(data_cfg, process_index, process_count)
  corpus = corpora.load(data_cfg)
  tokenizer = load_tokenizer(data_cfg, workdir, cache=not read_only,
                             train_texts=corpus.train.texts if corpus.train else None)
  train, val = token_streams(corpus, tokenizer)
  info = {"corpus": data_cfg.corpus, "tokenizer": data_cfg.tokenizer,
          "vocab_size": tokenizer.vocab_size, "train_tokens": len(train),
          "val_tokens": len(val), "val_documents": val.names}
  return DataSource(tokenizer, train, val, process_index, process_count,
                    shuffle_buffer=int(data_cfg.get("shuffle_buffer", 0)),
                    worker_count=int(data_cfg.get("worker_count", 0)), info=info)

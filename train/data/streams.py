"""Token streams: a tokenized split as read-only token arrays with document boundaries.

`token_streams(corpus, tokenizer)` is the third step of the data path
(train/data/pipeline.py:make_source): a split corpus and its tokenizer -> the
train and validation TokenStreams. Text documents are tokenized in memory;
`.bin` token files stay memmapped.
"""

from __future__ import annotations

import numpy as np

from train.data.corpora import Corpus, TextSplit
from train.data.tokenizers import Tokenizer, encode_many


class TokenStream:
  """Read-only concatenation of token arrays (in memory or memmapped .bin files)
  with document boundaries: piece starts, explicit `doc_starts`, and the token
  after each `eos_id`. Pickles memmaps by path, so grain workers never copy them.
  """

  def __init__(self, pieces: list[np.ndarray], doc_starts=None, eos_id: int | None = None,
               names: list[str] | None = None, start: int = 0, stop: int | None = None):
    self.pieces = list(pieces)
    self.offsets = np.cumsum([0] + [len(p) for p in self.pieces])
    total = int(self.offsets[-1])
    self.start, self.stop = start, total if stop is None else stop
    if not 0 <= self.start <= self.stop <= total:
      raise ValueError(f"TokenStream range [{start}, {stop}) outside [0, {total}]")
    starts = self.offsets[:-1] if doc_starts is None else np.asarray(doc_starts)
    self.doc_starts = np.unique(np.concatenate([starts, self.offsets[:-1]])).astype(np.int64)
    self.eos_id = eos_id
    self.names = list(names or [])

  def view(self, start: int, stop: int, names=None) -> TokenStream:
    """The sub-stream [start, stop) of this one's tokens (a split)."""
    return TokenStream(self.pieces, self.doc_starts, self.eos_id, names,
                       self.start + start, self.start + stop)

  def __len__(self) -> int:
    return self.stop - self.start

  def _tokens(self, a: int, b: int) -> np.ndarray:
    """Absolute range [a, b) as int64, gathered across pieces."""
    first = int(np.searchsorted(self.offsets, a, side="right")) - 1
    out = []
    while a < b:
      lo, hi = self.offsets[first], self.offsets[first + 1]
      take = min(b, hi)
      out.append(np.asarray(self.pieces[first][a - lo:take - lo], np.int64))
      a, first = take, first + 1
    return np.concatenate(out) if out else np.zeros([0], np.int64)

  def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens [start, stop) of this stream and whether each begins a document."""
    a, b = self.start + start, self.start + stop
    if not self.start <= a <= b <= self.stop:
      raise IndexError(f"read [{start}, {stop}) outside stream of length {len(self)}")
    lead = 1 if a > 0 else 0  # One token before, to see an EOS ending the previous document.
    toks = self._tokens(a - lead, b)
    new_doc = np.zeros([b - a], bool)
    lo, hi = np.searchsorted(self.doc_starts, [a, b])
    new_doc[self.doc_starts[lo:hi] - a] = True
    if self.eos_id is not None and b > a:
      prev = toks[:b - a] if lead else np.concatenate([[-1], toks[:-1]])
      new_doc |= prev == self.eos_id
    return toks[lead:], new_doc

  def __getstate__(self):
    state = dict(self.__dict__)
    state["pieces"] = [(p.filename, p.dtype.str, p.offset, p.shape)
                       if isinstance(p, np.memmap) else p for p in self.pieces]
    return state

  def __setstate__(self, state):
    state["pieces"] = [np.memmap(p[0], dtype=p[1], mode="r", offset=p[2], shape=p[3])
                       if isinstance(p, tuple) else p for p in state["pieces"]]
    self.__dict__.update(state)


def token_streams(corpus: Corpus, tokenizer: Tokenizer) -> tuple[TokenStream, TokenStream]:
  """(train, val): text documents tokenized in memory; .bin files stay memmapped,
  their validation split being the last `corpus.val_tokens` tokens."""
  if corpus.pieces is None:
    return text_stream(tokenizer, corpus.train), text_stream(tokenizer, corpus.val)
  whole = TokenStream(corpus.pieces, eos_id=tokenizer.eos_id)
  cut = len(whole) - corpus.val_tokens
  return (whole.view(0, cut, corpus.files),
          whole.view(cut, len(whole), [f"last {len(whole) - cut} tokens"]))


def text_stream(tokenizer: Tokenizer, split: TextSplit) -> TokenStream:
  """Documents concatenated, each followed by EOS when the tokenizer has one."""
  docs = encode_many(tokenizer, split.texts)
  if tokenizer.eos_id is not None:
    docs = [np.append(d, np.int32(tokenizer.eos_id)) for d in docs]
  docs = [d for d in docs if len(d)]
  tokens = np.concatenate(docs).astype(np.int32) if docs else np.zeros([0], np.int32)
  starts = np.cumsum([0] + [len(d) for d in docs[:-1]])
  return TokenStream([tokens], doc_starts=starts, eos_id=tokenizer.eos_id, names=split.names)

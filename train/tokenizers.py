"""Tokenizers: byte-level (default) and SentencePiece BPE trained on the train split.

Every tokenizer exposes `token_bytes[V]`, the UTF-8 length of the text each
token stands for, so evaluation can report bits per byte, a figure comparable
across tokenizers (bytes, unlike tokens, do not depend on the vocabulary).
"""

from __future__ import annotations

import io
import os
from typing import Iterable, Protocol, Sequence

import numpy as np

SPM_FILE = os.path.join("tokenizer", "spm.model")  # Relative to the run directory.


class Tokenizer(Protocol):
  vocab_size: int
  eos_id: int | None
  token_bytes: np.ndarray  # [V] int32: UTF-8 bytes each token decodes to.

  def encode(self, text: str) -> list[int]:
    ...

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    ...


def _valid_ids(ids, vocab_size: int) -> list[int]:
  # Models often pad the vocabulary beyond the tokenizer's; such ids decode to
  # nothing rather than crash a sampling loop.
  return [int(i) for i in np.asarray(ids).reshape(-1) if 0 <= i < vocab_size]


class ByteTokenizer:
  """UTF-8 bytes as tokens: vocab 256, nothing to train, no EOS."""

  vocab_size = 256
  eos_id = None

  def __init__(self):
    self.token_bytes = np.ones([256], np.int32)

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def encode_many(self, texts: Sequence[str]) -> list[np.ndarray]:
    return [np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.int32) for t in texts]

  def decode(self, ids) -> str:
    return bytes(_valid_ids(ids, 256)).decode("utf-8", errors="replace")


def _spm():
  import sentencepiece  # pylint: disable=g-import-not-at-top  # Only SP runs pay the import.
  return sentencepiece


class SentencePieceTokenizer:
  """A SentencePiece model; `train` builds BPE with byte fallback.

  Training settings make encode/decode an exact round trip for any UTF-8 text:
  identity normalisation, whitespace kept as is, no dummy prefix, byte
  fallback for characters outside the vocabulary, "\\n" as its own piece
  (SentencePiece trains on lines, so a newline would otherwise only ever be
  a fallback byte).
  """

  def __init__(self, model_proto: bytes):
    self.model_proto = bytes(model_proto)
    self.sp = _spm().SentencePieceProcessor(model_proto=self.model_proto)
    self.vocab_size = int(self.sp.get_piece_size())
    eos = int(self.sp.eos_id())
    self.eos_id = eos if eos >= 0 else None
    self.token_bytes = np.array([self._piece_bytes(i) for i in range(self.vocab_size)], np.int32)

  def _piece_bytes(self, i: int) -> int:
    sp = self.sp
    if sp.is_byte(i):
      return 1
    if sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i):
      return 0
    return len(sp.id_to_piece(i).replace("\u2581", " ").encode("utf-8"))

  @classmethod
  def train(cls, texts: Iterable[str], vocab_size: int) -> SentencePieceTokenizer:
    """Trains BPE on `texts` (documents). Deterministic: one thread, fixed seed."""
    spm = _spm()
    lines = (line for text in texts for line in text.split("\n") if line)
    out = io.BytesIO()
    spm.set_random_generator_seed(0)
    try:
      spm.SentencePieceTrainer.train(
          sentence_iterator=lines, model_writer=out, vocab_size=vocab_size,
          model_type="bpe", byte_fallback=True, character_coverage=0.9995,
          normalization_rule_name="identity", remove_extra_whitespaces=False,
          add_dummy_prefix=False, allow_whitespace_only_pieces=True,
          user_defined_symbols=["\n"], unk_id=0, eos_id=1, bos_id=-1, pad_id=-1,
          max_sentence_length=1 << 16, input_sentence_size=2_000_000,
          shuffle_input_sentence=True, num_threads=1, minloglevel=2)
    except RuntimeError as e:  # SentencePiece reports a bad size as RuntimeError.
      raise ValueError(f"data.vocab_size={vocab_size}: SentencePiece training failed "
                       f"({e}); byte fallback needs at least 256 + 3 + the corpus's "
                       "characters, and the corpus must support that many pieces") from e
    return cls(out.getvalue())

  @classmethod
  def load(cls, path: str) -> SentencePieceTokenizer:
    if not os.path.isfile(path):
      raise FileNotFoundError(f"SentencePiece model not found: {path}")
    with open(path, "rb") as f:
      return cls(f.read())

  def save(self, path: str) -> None:
    """Writes atomically, so a crash or a second host never leaves half a file."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
      f.write(self.model_proto)
    os.replace(tmp, path)

  def encode(self, text: str) -> list[int]:
    return self.sp.encode(text)

  def encode_many(self, texts: Sequence[str]) -> list[np.ndarray]:
    return [np.asarray(ids, np.int32) for ids in self.sp.encode(list(texts))]

  def decode(self, ids) -> str:
    return self.sp.decode(_valid_ids(ids, self.vocab_size))


def encode_many(tokenizer: Tokenizer, texts: Sequence[str]) -> list[np.ndarray]:
  """Tokenizes documents to int32 arrays, in bulk where the tokenizer can."""
  if hasattr(tokenizer, "encode_many"):
    return tokenizer.encode_many(texts)
  return [np.asarray(tokenizer.encode(t), np.int32) for t in texts]


def load_tokenizer(data_cfg, workdir: str | None,
                   train_texts: Iterable[str] | None = None, cache: bool = True) -> Tokenizer:
  """The run's tokenizer: `data_cfg.tokenizer` is "byte" or "sentencepiece".

  SentencePiece, in order: the model cached in `workdir/tokenizer/spm.model`
  (a resumed run gets the identical tokenizer), else `data_cfg.spm_model` (a
  given model file), else one trained on `train_texts` (the train split only).
  A new model is saved to the workdir cache (unless `cache` is False: readers of a
  run never write to it). Every host trains the same model
  (training is deterministic), so no host waits on another's file.
  """
  kind = data_cfg.tokenizer
  if kind == "byte":
    return ByteTokenizer()
  if kind != "sentencepiece":
    raise ValueError(f"data.tokenizer={kind!r}: must be 'byte' or 'sentencepiece'")
  vocab_size = int(data_cfg.vocab_size)
  cached = os.path.join(workdir, SPM_FILE) if workdir else None
  given = data_cfg.get("spm_model") or None
  if cached and os.path.isfile(cached):
    tok = SentencePieceTokenizer.load(cached)
    source = f"the cached {cached}"
  elif given:
    tok = SentencePieceTokenizer.load(given)
    source = f"data.spm_model={given!r}"
  elif train_texts is not None:
    tok = SentencePieceTokenizer.train(train_texts, vocab_size)
    source = "the newly trained model"
  else:
    raise ValueError("data.tokenizer='sentencepiece' needs a model: none is cached in the "
                     "workdir, data.spm_model is unset, and this corpus has no text to "
                     "train one on (pre-tokenized .bin corpora need data.spm_model)")
  if tok.vocab_size != vocab_size:
    raise ValueError(f"data.vocab_size={vocab_size} but {source} has "
                     f"{tok.vocab_size} pieces")
  if cache and cached and not os.path.isfile(cached):
    tok.save(cached)
  return tok

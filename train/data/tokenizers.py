"""Tokenizers: byte-level (default), SentencePiece BPE trained on the train split, and
Hugging Face `tokenizer.json` files (Llama 3, Qwen2, Mistral-Nemo byte-level BPE).

Every tokenizer exposes `token_bytes[V]`, the UTF-8 length of the text each
token stands for, so evaluation can report bits per byte, a figure comparable
across tokenizers (bytes, unlike tokens, do not depend on the vocabulary).
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
from typing import Callable, Iterable, Protocol, Sequence

import numpy as np

from train.data.hf_tokenizer import HFTokenizer, valid_ids
from train.data.slow_notice import SlowNotice
from train.io import staging

SPM_FILE = os.path.join("tokenizer", "spm.model")  # Relative to the run directory.
HF_DIR = "tokenizer"  # The run's copy of a tokenizer.json and its side files.
HF_FILES = ("tokenizer.json", "tokenizer_config.json")
# SentencePiece training longer than this gets log lines (a large corpus takes minutes).
SLOW_TRAINING_S = 10.0
log = logging.getLogger(__name__)


class Tokenizer(Protocol):
  vocab_size: int
  eos_id: int | None
  token_bytes: np.ndarray  # [V] int32: UTF-8 bytes each token decodes to.

  def encode(self, text: str) -> list[int]:
    ...

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    ...

  def identity(self) -> tuple[str, bytes]:
    """(kind, the bytes that define what it computes): `fingerprint`'s input."""
    ...


def fingerprint(tokenizer: Tokenizer) -> str:
  """A short stable id of what `tokenizer` computes ("sentencepiece-3f2a..."): equal
  fingerprints encode every text alike. Recorded with runs and prepared datasets, so
  a run never silently continues, or reads data, under another tokenizer."""
  kind, definition = tokenizer.identity()
  return f"{kind}-{hashlib.sha256(definition).hexdigest()[:16]}"


def require_tokenizer(tokenizer: Tokenizer, want: str | None,
                      mismatch: Callable[[str, str], str]) -> str:
  """`tokenizer`'s fingerprint, after refusing it unless it is `want` (None: any): the one
  comparison of fingerprints, for a run's recorded tokenizer and a prepared dataset's
  alike. `mismatch(got, want)` says what the difference means where it is found."""
  got = fingerprint(tokenizer)
  if want and got != want:
    raise ValueError(mismatch(got, want))
  return got


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
    return bytes(valid_ids(ids, 256)).decode("utf-8", errors="replace")

  def identity(self) -> tuple[str, bytes]:
    return "byte", b"utf-8 bytes"


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
    read = {"lines": 0, "chars": 0}

    def lines():
      for text in texts:
        for line in text.split("\n"):
          if line:
            read["lines"] += 1
            read["chars"] += len(line)
            yield line

    out = io.BytesIO()
    spm.set_random_generator_seed(0)
    with SlowNotice(f"training a SentencePiece BPE tokenizer (vocab {vocab_size})", read,
                    SLOW_TRAINING_S, log):
      return cls(cls._train(spm, lines(), out, vocab_size))

  @staticmethod
  def _train(spm, lines, out: io.BytesIO, vocab_size: int) -> bytes:
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
    return out.getvalue()

  @classmethod
  def load(cls, path: str) -> SentencePieceTokenizer:
    if not os.path.isfile(path):
      raise FileNotFoundError(f"SentencePiece model not found: {path}")
    with open(path, "rb") as f:
      proto = f.read()
    try:
      return cls(proto)
    except (RuntimeError, ValueError, TypeError) as e:  # SentencePiece's INTERNAL errors.
      raise ValueError(f"{path} is not a SentencePiece model ({e})") from None

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
    return self.sp.decode(valid_ids(ids, self.vocab_size))

  def identity(self) -> tuple[str, bytes]:
    return "sentencepiece", self.model_proto


def encode_many(tokenizer: Tokenizer, texts: Sequence[str]) -> list[np.ndarray]:
  """Tokenizes documents to int32 arrays, in bulk where the tokenizer can."""
  if hasattr(tokenizer, "encode_many"):
    return tokenizer.encode_many(texts)
  return [np.asarray(tokenizer.encode(t), np.int32) for t in texts]


def load_tokenizer(data_cfg, workdir: str | None,
                   train_texts: Iterable[str] | None = None, cache: bool = True,
                   expect: str | None = None) -> Tokenizer:
  """The run's tokenizer: `data_cfg.tokenizer` is "byte", "sentencepiece", "hf", "hf:PATH".

  SentencePiece, in order: the model cached in `workdir/tokenizer/spm.model`
  (a resumed run gets the identical tokenizer), else `data_cfg.spm_model` (a
  given model file), else one trained on `train_texts` (the train split only).
  A new model is saved to the workdir cache (unless `cache` is False: readers never
  write to it, nor train one). Every host trains the same (deterministic) model.

  `expect`: the `fingerprint` a run recorded in its config.json; a tokenizer that is
  not that one (a deleted spm.model that would be trained again, another file) is
  refused before anything is trained, cached or computed with it.
  """
  with staging.staged(workdir, HF_DIR) as local:  # A bucket run: a local copy of tokenizer/.
    return _check(_load_tokenizer(data_cfg, local, train_texts, cache, expect), expect,
                  data_cfg, local)


def _check(tok, expect: str | None, data_cfg, workdir: str | None):
  """`tok`, if it is the `expect`ed tokenizer (or nothing is expected); before caching."""
  require_tokenizer(tok, expect, lambda got, want: (
      f"data.tokenizer={data_cfg.tokenizer!r}: this is not the tokenizer the run in {workdir} "
      f"was trained with (its config.json records {want}, this one is {got}); restore the "
      f"run's {os.path.join(workdir or 'RUN', 'tokenizer')}/ or start a new --workdir"))
  return tok


def _load_tokenizer(data_cfg, workdir, train_texts, cache, expect) -> Tokenizer:
  kind = data_cfg.tokenizer
  if kind == "byte":
    return ByteTokenizer()
  if isinstance(kind, str) and (kind == "hf" or kind.startswith("hf:")):
    return _load_hf(data_cfg, workdir, cache, expect)
  if kind != "sentencepiece":
    raise ValueError(f"data.tokenizer={kind!r}: must be 'byte', 'sentencepiece', 'hf' or "
                     "'hf:PATH' (a Hugging Face tokenizer.json)")
  vocab_size = int(data_cfg.vocab_size)
  cached = os.path.join(workdir, SPM_FILE) if workdir else None
  given = data_cfg.spm_model or None
  if cached and os.path.isfile(cached):
    tok = SentencePieceTokenizer.load(cached)
    source = f"the cached {cached}"
  elif given:
    tok = SentencePieceTokenizer.load(given)
    source = f"data.spm_model={given!r}"
  elif cached and (expect or not cache):  # A run's own model is gone: never train another.
    known = f" (its fingerprint in config.json: {expect})" if expect else ""
    raise ValueError(f"{cached}, the SentencePiece model this run was trained with{known}, "
                     "is missing: restore it from a backup. A tokenizer trained again would "
                     "not be the one the weights were trained with.")
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
    _check(tok, expect, data_cfg, workdir)  # Never cache another tokenizer into the run.
    tok.save(cached)
  return tok


def _load_hf(data_cfg, workdir: str | None, cache: bool, expect: str | None) -> HFTokenizer:
  """"hf": the run's copy in `workdir/tokenizer/` (an import writes it). "hf:PATH":
  that copy if there is one (a resumed run keeps its tokenizer, as SentencePiece's
  cache does), else the tokenizer.json at PATH, then copied into the run (unless
  `cache` is False) so export and load_run find it without PATH."""
  kind = data_cfg.tokenizer
  cached = os.path.join(workdir, HF_DIR, "tokenizer.json") if workdir else None
  given = kind[3:] if kind.startswith("hf:") else None
  if cached and os.path.isfile(cached):
    tok, source = HFTokenizer.load(cached), f"the run's {cached}"
  elif given:
    if not os.path.isfile(given):
      raise FileNotFoundError(f"data.tokenizer={kind!r}: no such file {given!r}")
    tok, source = HFTokenizer.load(given), f"data.tokenizer={kind!r}"
  else:
    raise FileNotFoundError(f"data.tokenizer='hf' reads the run's tokenizer.json, but "
                            f"{cached or 'no workdir'} does not exist; use 'hf:PATH' to "
                            "name a tokenizer.json")
  if tok.vocab_size != int(data_cfg.vocab_size):
    raise ValueError(f"data.vocab_size={data_cfg.vocab_size} but {source} has "
                     f"{tok.vocab_size} tokens")
  if cache and cached and not os.path.isfile(cached):
    _check(tok, expect, data_cfg, workdir)  # Never cache another tokenizer into the run.
    tok.save(os.path.dirname(cached))
  return tok

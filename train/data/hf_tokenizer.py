"""Hugging Face `tokenizer.json` files (Llama 3, Qwen2, Mistral-Nemo byte-level BPE) as a
blockwork tokenizer (train/data/tokenizers.py: the Tokenizer protocol, loading, checks)."""

from __future__ import annotations

import json
import os
from typing import Sequence

import numpy as np

from train.io.jsonfile import read_json_object


def valid_ids(ids, vocab_size: int) -> list[int]:
  # Models often pad the vocabulary beyond the tokenizer's; such ids decode to
  # nothing rather than crash a sampling loop.
  return [int(i) for i in np.asarray(ids).reshape(-1) if 0 <= i < vocab_size]


def _read_json(path: str) -> dict:
  """A tokenizer's side file ({} when absent); one ValueError naming it when it is not JSON."""
  return read_json_object(path) if os.path.isfile(path) else {}


def _component_types(spec) -> set[str]:
  """Every "type" in a tokenizer.json component, through Sequence nesting."""
  if isinstance(spec, dict):
    return {spec.get("type")} | {t for v in spec.values() for t in _component_types(v)}
  if isinstance(spec, list):
    return {t for v in spec for t in _component_types(v)}
  return set()


class HFTokenizer:
  """A Hugging Face `tokenizer.json`, through the `tokenizers` library.

  `encode` applies the file's post-processor (e.g. Llama 3's BOS), as the model
  was trained with it; `decode` drops special tokens, so generated text reads
  clean. The end token is tokenizer_config.json's `eos_token`, else config.json's
  `eos_token_id` (both read next to tokenizer.json; the first of a list).

  `token_bytes`: special tokens count 0 bytes (they stand for no text, as
  SentencePiece's control pieces); byte-level BPE tokens count one byte per
  character (each character of such a token encodes one byte); SentencePiece-style
  files (Metaspace / byte fallback) count "<0xNN>" as 1 and "\\u2581" as a space.
  """

  def __init__(self, json_text: str, config: dict | None = None, hf_config: dict | None = None):
    import tokenizers  # pylint: disable=g-import-not-at-top  # Only HF-tokenizer runs pay it.
    self.json_text = json_text
    self.config = dict(config or {})
    self.tok = tokenizers.Tokenizer.from_str(json_text)
    vocab = self.tok.get_vocab(with_added_tokens=True)
    self.vocab_size = max(vocab.values(), default=-1) + 1
    hf = hf_config or {}
    self.eos_id = self._special_id("eos_token", hf.get("eos_token_id"))
    self.bos_id = self._special_id("bos_token", hf.get("bos_token_id"))
    self.token_bytes = self._token_bytes(vocab, json.loads(json_text),
                                         set(tokenizers.pre_tokenizers.ByteLevel.alphabet()))

  def _special_id(self, key: str, fallback) -> int | None:
    token = self.config.get(key)
    token = token.get("content") if isinstance(token, dict) else token
    found = self.tok.token_to_id(token) if isinstance(token, str) else None
    if found is not None:
      return int(found)
    fallback = fallback[0] if isinstance(fallback, list) and fallback else fallback
    ok = isinstance(fallback, int) and not isinstance(fallback, bool)
    return fallback if ok and 0 <= fallback < self.vocab_size else None

  def _token_bytes(self, vocab: dict[str, int], spec: dict, alphabet: set[str]) -> np.ndarray:
    out = np.zeros([self.vocab_size], np.int32)
    byte_level = "ByteLevel" in _component_types(spec.get("decoder"))
    added = self.tok.get_added_tokens_decoder()
    for piece, i in vocab.items():
      if i in added:  # Matched literally in raw text: its own bytes, or none if special.
        out[i] = 0 if added[i].special else len(added[i].content.encode("utf-8"))
      elif byte_level and set(piece) <= alphabet:
        out[i] = len(piece)
      elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        out[i] = 1
      else:
        out[i] = len(piece.replace("\u2581", " ").encode("utf-8"))
    return out

  @classmethod
  def load(cls, path: str) -> HFTokenizer:
    """`path`: a tokenizer.json; its side files are read from the same directory."""
    if not os.path.isfile(path):
      raise FileNotFoundError(f"tokenizer.json not found: {path}")
    try:
      with open(path, encoding="utf-8") as f:
        text = f.read()
    except UnicodeDecodeError as e:
      raise ValueError(f"{path} is not UTF-8 text ({e})") from None
    where = os.path.dirname(path)
    side = (_read_json(os.path.join(where, "tokenizer_config.json")),
            _read_json(os.path.join(where, "config.json")))
    try:
      return cls(text, *side)
    except Exception as e:  # pylint: disable=broad-except  # The tokenizers library's errors.
      raise ValueError(f"{path} is not a tokenizer.json the tokenizers library reads "
                       f"({type(e).__name__}: {str(e)[:200]})") from None

  def save(self, directory: str) -> None:
    """tokenizer.json, tokenizer_config.json (if any) and a config.json holding only
    the resolved end / start ids, so `load` finds the same ids without the model's
    config. Each file is written atomically."""
    ids = {k: v for k, v in (("eos_token_id", self.eos_id), ("bos_token_id", self.bos_id))
           if v is not None}
    files = {"tokenizer.json": self.json_text, "config.json": json.dumps(ids)}
    if self.config:
      files["tokenizer_config.json"] = json.dumps(self.config, indent=2)
    os.makedirs(directory, exist_ok=True)
    for name, text in files.items():
      tmp = os.path.join(directory, f"{name}.tmp{os.getpid()}")
      with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
      os.replace(tmp, os.path.join(directory, name))

  def encode(self, text: str) -> list[int]:
    return self.tok.encode(text).ids

  def encode_many(self, texts: Sequence[str]) -> list[np.ndarray]:
    return [np.asarray(e.ids, np.int32) for e in self.tok.encode_batch(list(texts))]

  def decode(self, ids) -> str:
    return self.tok.decode(valid_ids(ids, self.vocab_size), skip_special_tokens=True)

  def identity(self) -> tuple[str, bytes]:
    # The special-token ids decide what encode appends (BOS) and where generation stops.
    ids = json.dumps([self.eos_id, self.bos_id, self.config], sort_keys=True)
    return "hf", (self.json_text + ids).encode("utf-8")

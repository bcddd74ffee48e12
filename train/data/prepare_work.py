"""What a prepare worker does to one Chunk: parse, check, split and tokenize its documents.

Runs in worker processes (train/data/prepare.py starts them with `init`), or in
the preparing process itself with `workers=0`. A document goes to validation when
the sha256 of its identity ("path/in/corpus.jsonl#17", or the id field's value)
falls below `val_fraction`: a fixed choice per document, so adding files or
re-sharding moves nothing else, and the splits never overlap.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np

from train.data.formats import Chunk
from train.data.tokenizers import (ByteTokenizer, HFTokenizer, SentencePieceTokenizer,
                                   Tokenizer, encode_many)

SPLITS = ("train", "validation")


@dataclasses.dataclass(frozen=True)
class Settings:
  text_field: str
  id_field: str
  val_fraction: float
  skip_bad: bool  # Skip (and count) malformed records instead of stopping.
  tokenizer: tuple  # tokenizer_spec(tokenizer): rebuilt in each worker.
  dtype: str  # "uint16" | "uint32"


def tokenizer_spec(tok: Tokenizer) -> tuple:
  """A picklable description a worker rebuilds `tok` from."""
  if isinstance(tok, ByteTokenizer):
    return ("byte",)
  if isinstance(tok, SentencePieceTokenizer):
    return ("sentencepiece", tok.model_proto)
  if isinstance(tok, HFTokenizer):
    return ("hf", tok.json_text, tok.config, {"eos_token_id": tok.eos_id,
                                              "bos_token_id": tok.bos_id})
  raise TypeError(f"prepare cannot ship a {type(tok).__name__} to its workers")


def from_spec(spec: tuple) -> Tokenizer:
  if spec[0] == "byte":
    return ByteTokenizer()
  if spec[0] == "sentencepiece":
    return SentencePieceTokenizer(spec[1])
  return HFTokenizer(*spec[1:])


_STATE = {}


def init(settings: Settings) -> None:
  """Worker start-up: builds the tokenizer once per process."""
  _STATE["settings"], _STATE["tokenizer"] = settings, from_spec(settings.tokenizer)


def is_validation(identity: str, fraction: float) -> bool:
  h = int.from_bytes(hashlib.sha256(identity.encode("utf-8", "surrogatepass")).digest()[:8],
                     "big")
  return h < fraction * 2.0**64


class _Bad(Exception):

  def __init__(self, reason: str, message: str):
    super().__init__(message)
    self.reason = reason


def _jsonl_text(line: bytes, field: str, id_field: str) -> tuple[str | None, str | None]:
  """(text, id) of one JSONL line; (None, None) for a blank line."""
  if not line.strip():
    return None, None
  try:
    obj = json.loads(line)
  except UnicodeDecodeError as e:
    raise _Bad("bad_utf8", f"not UTF-8 ({e.reason} at byte {e.start})") from None
  except json.JSONDecodeError as e:
    raise _Bad("bad_json", f"not valid JSON ({e.msg}, column {e.colno})") from None
  if not isinstance(obj, dict):
    raise _Bad("bad_json", f"a JSON {type(obj).__name__}, not an object")
  if field not in obj:
    raise _Bad("missing_field", f"no {field!r} field (fields: {sorted(obj)[:8]}); set the "
               "text field (--text_field) to the one holding the text")
  ident = obj.get(id_field) if id_field else None
  return obj[field], (None if ident is None else str(ident))


def _check_text(text) -> str:
  if not isinstance(text, str):
    raise _Bad("not_text", f"the text field holds a {type(text).__name__}, not a string")
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    raise _Bad("bad_utf8", f"text is not valid Unicode ({e.reason})") from None
  return text


def documents(chunk: Chunk, s: Settings) -> tuple[list[tuple[str, str]], dict[str, int]]:
  """[(identity, text)] of a chunk and what was skipped {reason: count}; raises
  ValueError naming the file and record for a bad one unless `s.skip_bad`."""
  docs, skipped = [], {}
  for i, item in enumerate(chunk.items):
    number = chunk.first + i
    try:
      ident = chunk.ids[i] if chunk.ids else None
      if chunk.kind == "jsonl":
        text, ident = _jsonl_text(item, s.text_field, s.id_field)
        if text is None:
          skipped["blank_lines"] = skipped.get("blank_lines", 0) + 1
          continue
      elif chunk.kind == "text":
        try:
          text = item.decode("utf-8")
        except UnicodeDecodeError as e:
          raise _Bad("bad_utf8", f"not UTF-8 text ({e.reason} at byte {e.start})") from None
      else:
        text = item
      text = _check_text(text)
    except _Bad as e:
      where = chunk.path if chunk.kind == "text" else (
          f"{chunk.path}:{number}" if chunk.kind == "jsonl" else f"{chunk.path} row {number}")
      if not s.skip_bad:
        raise ValueError(f"{where}: {e} (pass --skip_bad_records to skip such records, "
                         "counted in the manifest)") from None
      skipped[e.reason] = skipped.get(e.reason, 0) + 1
      continue
    if not text:
      skipped["empty"] = skipped.get("empty", 0) + 1
      continue
    if ident is None:
      ident = chunk.rel if chunk.kind == "text" else f"{chunk.rel}#{number}"
    docs.append((ident, text))
  return docs, skipped


def encode_split(tok: Tokenizer, texts: list[str], dtype: str):
  """(tokens [T] of `dtype`, tokens per document [n], UTF-8 bytes per document [n]);
  each document ends with the tokenizer's EOS when it has one."""
  if isinstance(tok, ByteTokenizer):  # Bytes are the tokens: one encode, no int32 copies.
    encoded = [t.encode("utf-8") for t in texts]
    nbytes = np.array([len(b) for b in encoded], np.int64)
    return np.frombuffer(b"".join(encoded), np.uint8).astype(dtype), nbytes, nbytes
  arrays = encode_many(tok, texts) if texts else []
  if tok.eos_id is not None:
    arrays = [np.append(a, np.int32(tok.eos_id)) for a in arrays]
  lengths = np.array([len(a) for a in arrays], np.int64)
  nbytes = np.array([len(t.encode("utf-8")) for t in texts], np.int64)
  tokens = np.concatenate(arrays).astype(dtype) if arrays else np.zeros([0], dtype)
  return tokens, lengths, nbytes


def process(chunk: Chunk) -> dict:
  """A chunk's two splits, tokenized: {"source", "splits": {split: (tokens, lengths,
  bytes)}, "skipped", "error", "offset" (its input bytes done), "text_bytes" (its
  documents' UTF-8 bytes)}. Errors come back as text (they name file and line)."""
  s, tok = _STATE["settings"], _STATE["tokenizer"]
  try:
    docs, skipped = documents(chunk, s)
  except ValueError as e:
    return {"source": chunk.source, "error": str(e)}
  parts = {k: [] for k in SPLITS}
  for ident, text in docs:
    parts["validation" if is_validation(ident, s.val_fraction) else "train"].append(text)
  splits = {k: encode_split(tok, parts[k], s.dtype) for k in SPLITS}
  return {"source": chunk.source, "error": None, "skipped": skipped, "splits": splits,
          "offset": chunk.offset, "text_bytes": int(sum(v[2].sum() for v in splits.values()))}

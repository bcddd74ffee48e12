"""Input formats of `--mode prepare`: finding the source files and streaming their records.

`find_sources(inputs)` resolves what the user named (files, directories, globs, a
Hugging Face dataset saved to disk, `hf:NAME` on the hub) into `InputFile`s, each
with the format its name says:

  .txt                     one document per file (UTF-8)
  .jsonl .jsonl.gz .jsonl.zst   one JSON object per line; a setting names the text field
  .parquet                 a column holds the text (pyarrow, row group by row group)
  .arrow                   the files of a `datasets` dataset saved with save_to_disk
                           (Arrow IPC streams, read with pyarrow: no `datasets` needed)
  hf:NAME                  a hub dataset, streamed by `datasets` when it is installed

`read_chunks(src, ...)` streams one file as `Chunk`s of raw records (JSONL lines
stay bytes, parsed in the workers), so memory stays bounded by a chunk, and hashes
the file's bytes on the way (the manifest's sha256).
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import hashlib
import io
import json
import os
from typing import Iterator

SUFFIXES = {".txt": "text", ".jsonl": "jsonl", ".jsonl.gz": "jsonl", ".jsonl.zst": "jsonl",
            ".parquet": "parquet", ".arrow": "arrow"}
CHUNK_BYTES = 4 << 20  # Raw input per chunk handed to a worker.
CHUNK_RECORDS = 4096


class PrepareError(ValueError):
  """Bad input to prepare: the message names the file (and line) and the problem."""


@dataclasses.dataclass(frozen=True)
class InputFile:
  path: str  # Local path, or "hf:NAME" for a hub dataset.
  kind: str  # "text" | "jsonl" | "parquet" | "arrow" | "hub"
  rel: str  # Stable name: the document identities' prefix (relative to the input root).
  size: int
  mtime: float


@dataclasses.dataclass
class Chunk:
  source: int  # Index into the plan's sources.
  kind: str
  path: str  # For error messages.
  rel: str
  first: int  # Record number (JSONL: line number) of items[0], 1-based.
  items: list  # bytes lines (jsonl), bytes (text file), str texts (parquet/arrow/hub).
  ids: list | None = None  # Column-format id field values, when one is set.
  # The source's input bytes consumed once this chunk is done (the progress line counts
  # the chunks tokenized, not those read ahead into the workers' window).
  offset: int = 0


def suffix_kind(path: str) -> str | None:
  low = path.lower()
  for suffix in sorted(SUFFIXES, key=len, reverse=True):
    if low.endswith(suffix):
      return SUFFIXES[suffix]
  return None


def _hf_saved_files(path: str) -> list[str] | None:
  """The .arrow files of a dataset saved with `save_to_disk` (a Dataset, or a
  DatasetDict's "train" split), or None if `path` is not one."""
  if os.path.isfile(os.path.join(path, "dataset_dict.json")):
    with open(os.path.join(path, "dataset_dict.json")) as f:
      splits = json.load(f).get("splits", [])
    if "train" not in splits:
      raise PrepareError(f"{path}: a saved DatasetDict without a 'train' split (splits: "
                         f"{splits}); name the split's directory, e.g. {path}/{splits[0]}"
                         if splits else f"{path}: a saved DatasetDict with no splits")
    path = os.path.join(path, "train")
  state = os.path.join(path, "state.json")
  if not os.path.isfile(state):
    return None
  with open(state) as f:
    names = [d["filename"] for d in json.load(f).get("_data_files", [])]
  return [os.path.join(path, n) for n in names]


def _expand(spec: str) -> tuple[str, list[str]]:
  """One input spec -> (its root, the files it names)."""
  path = os.path.expanduser(spec)
  if os.path.isdir(path):
    saved = _hf_saved_files(path)
    if saved is not None:
      return path, saved
    files = [f for f in glob.glob(os.path.join(path, "**", "*"), recursive=True)
             if os.path.isfile(f) and suffix_kind(f) not in (None, "arrow")]
    if not files:
      raise PrepareError(f"input {spec!r}: the directory has no {', '.join(SUFFIXES)} files")
    return path, files
  if glob.has_magic(path):
    files = [f for f in glob.glob(path, recursive=True) if os.path.isfile(f)]
    if not files:
      raise PrepareError(f"input {spec!r}: the pattern matches no files")
    root = path
    while glob.has_magic(root):
      root = os.path.dirname(root)
    return root, files
  if not os.path.isfile(path):
    raise PrepareError(f"input {spec!r}: no such file or directory")
  return os.path.dirname(path), [path]


def find_sources(inputs: list[str]) -> list[InputFile]:
  """Every input file, sorted by identity name; names are relative to each input's
  root, so moving the corpus elsewhere (or adding files) changes no identity."""
  out = {}
  for spec in inputs:
    if spec.startswith("hf:"):
      _need_datasets(spec)
      out[spec] = InputFile(spec, "hub", spec, 0, 0.0)
      continue
    root, files = _expand(spec)
    for f in files:
      kind = suffix_kind(f)
      if kind is None:
        raise PrepareError(f"{f}: unknown format; prepare reads {', '.join(SUFFIXES)}")
      rel = os.path.relpath(f, root) if root else f
      st = os.stat(f)
      out.setdefault(rel, InputFile(os.path.abspath(f), kind, rel, st.st_size, st.st_mtime))
  if not out:
    raise PrepareError(f"inputs {inputs}: nothing to prepare")
  return [out[k] for k in sorted(out)]


def _need_datasets(spec: str):
  try:
    import datasets  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise PrepareError(f"input {spec!r}: reading a hub dataset needs the `datasets` "
                       "package (pip install -e '.[hub]'), which the default install "
                       "leaves out; or save it with save_to_disk where it is installed and "
                       "prepare that directory") from None
  return datasets


class _Hashing(io.RawIOBase):
  """A read-only file that hashes every byte read and counts them (the progress)."""

  def __init__(self, f):
    self.f, self.sha, self.done = f, hashlib.sha256(), 0

  def readable(self):
    return True

  def readinto(self, b):
    n = self.f.readinto(b)
    if n:
      self.sha.update(memoryview(b)[:n])
      self.done += n
    return n

  def drain(self) -> str:
    """Reads (and hashes) whatever the decompressor left unread; the file's sha256."""
    buf = bytearray(1 << 20)
    while self.readinto(buf):
      pass
    return self.sha.hexdigest()


def file_sha256(path: str) -> str:
  sha = hashlib.sha256()
  with open(path, "rb") as f:
    while block := f.read(8 << 20):
      sha.update(block)
  return sha.hexdigest()


class Reader:
  """Streams one InputFile as Chunks; `done` is the input bytes consumed so far and,
  once the iteration ends, `sha256` the file's hash."""

  def __init__(self, src: InputFile, index: int, text_field: str, id_field: str = ""):
    self.src, self.index = src, index
    self.text_field, self.id_field = text_field, id_field
    self.done, self.sha256 = 0, None
    self._raw = None

  def __iter__(self) -> Iterator[Chunk]:
    read = {"text": self._text, "jsonl": self._jsonl, "parquet": self._columns,
            "arrow": self._columns, "hub": self._hub}[self.src.kind]
    yield from read()

  def _chunk(self, first: int, items: list, ids: list | None = None) -> Chunk:
    return Chunk(self.index, self.src.kind, self.src.path, self.src.rel, first, items, ids,
                 self.done)

  def _text(self):
    with open(self.src.path, "rb") as f:
      data = f.read()
    self.done = len(data)
    self.sha256 = hashlib.sha256(data).hexdigest()
    yield self._chunk(1, [data])

  def _jsonl(self):
    with open(self.src.path, "rb") as f:
      raw = _Hashing(f)
      self._raw = raw
      stream = _decompressed(self.src.path, io.BufferedReader(raw, 1 << 20))
      items, size, first = [], 0, 1
      for number, line in enumerate(stream, 1):
        if not items:
          first = number
        items.append(line)
        size += len(line)
        if size >= CHUNK_BYTES or len(items) >= CHUNK_RECORDS:
          self.done = raw.done
          yield self._chunk(first, items)
          items, size = [], 0
      if items:
        self.done = raw.done
        yield self._chunk(first, items)
      self.sha256 = raw.drain()
      self.done = raw.done

  def _columns(self):
    batches, rows = _column_batches(self.src, self.text_field, self.id_field)
    number = 1
    for batch in batches:
      texts = batch.column(self.text_field).to_pylist()
      ids = batch.column(self.id_field).to_pylist() if self.id_field else None
      self.done = int(self.src.size * min(1.0, (number + len(texts) - 1) / max(rows, 1)))
      yield self._chunk(number, texts, ids)
      number += len(texts)
    self.sha256 = file_sha256(self.src.path)
    self.done = self.src.size

  def _hub(self):
    datasets = _need_datasets(self.src.path)
    ds = datasets.load_dataset(self.src.path[3:], split="train", streaming=True)
    items, ids, number = [], [], 1
    for row in ds:
      if self.text_field not in row:
        raise PrepareError(f"{self.src.path}: record {number + len(items)} has no "
                           f"{self.text_field!r} field (fields: {sorted(row)})")
      items.append(row[self.text_field])
      ids.append(row.get(self.id_field) if self.id_field else None)
      if len(items) >= CHUNK_RECORDS:
        yield self._chunk(number, items, ids if self.id_field else None)
        number += len(items)
        items, ids = [], []
    if items:
      yield self._chunk(number, items, ids if self.id_field else None)
    self.sha256 = ""  # A streamed hub dataset has no file to hash; its name is recorded.


def _decompressed(path: str, f):
  low = path.lower()
  if low.endswith(".gz"):
    return gzip.GzipFile(fileobj=f)
  if low.endswith(".zst"):
    import zstandard  # pylint: disable=g-import-not-at-top
    return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(f), 1 << 20)
  return f


def _column_batches(src: InputFile, text_field: str, id_field: str):
  """(record batches of the text (and id) columns, total rows) of a Parquet or Arrow file."""
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  columns = [text_field] + ([id_field] if id_field else [])
  try:
    if src.kind == "parquet":
      import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
      pf = pq.ParquetFile(src.path)
      names = pf.schema_arrow.names
      batches = pf.iter_batches(batch_size=1024, columns=columns)
      rows = pf.metadata.num_rows
    else:
      reader = pa.ipc.open_stream(pa.memory_map(src.path))
      names = reader.schema.names
      batches = (b.select(columns) for b in reader)
      rows = max(src.size // 512, 1)  # Streams carry no row count; progress is approximate.
  except pa.ArrowInvalid as e:
    raise PrepareError(f"{src.path}: not a readable {src.kind} file ({e})") from None
  for c in columns:
    if c not in names:
      raise PrepareError(f"{src.path}: no column {c!r} (columns: {names}); set the text "
                         "field (--text_field) to the column holding the text")
  return batches, rows

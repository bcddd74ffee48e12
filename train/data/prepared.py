"""Reading a prepared dataset (train/data/prepare.py wrote it), local or in object storage.

    data.corpus = "prepared/web"            # a local prepared dataset
    data.corpus = "gs://bucket/prepared/web"  # or s3://..., any fsspec filesystem

Storage goes through fsspec (train/io/dataset_store.py; `gs://` needs `gcsfs`,
`s3://` needs `s3fs`): local files are memmapped; anything else is read by byte
ranges, one window at a time, so each host reads only its rows of each global batch
and nothing is copied whole to any host. Document starts are read per shard, when a
window first touches it.

A dataset is read only when its manifest says it is complete and every shard it
lists is there at the size it records; a half-written one (OUT.partial, or a
directory without manifest.json) is refused, and so is a run whose tokenizer is
not the dataset's (both fingerprints named).
"""

from __future__ import annotations

import collections
import json
import os

import numpy as np

from train.data.tokenizers import (HF_DIR, HF_FILES, SPM_FILE, ByteTokenizer, HFTokenizer,
                                   SentencePieceTokenizer, Tokenizer, require_tokenizer,
                                   load_tokenizer)
from train.io import staging
from train.io.dataset_store import Store

MANIFEST = "manifest.json"  # = train/data/prepare.py's (which this module must not import).
FORMAT = "blockwork-prepared/1"
SPLITS = {"train": "train", "val": "validation"}
# Shard arrays a stream keeps open (memmaps hold a file descriptor each) or fetched.
CACHED = 64


def is_prepared(corpus) -> bool:
  """A URL (gs://, s3://, memory://...) or a local directory prepare made (or began)."""
  if not isinstance(corpus, str) or not corpus:
    return False
  if "://" in corpus:
    return True
  path = os.path.expanduser(corpus)
  return any(os.path.isfile(os.path.join(path, f)) for f in (MANIFEST, "plan.json"))


def open_manifest(store: Store) -> dict:
  """The manifest of a complete dataset, its shards checked; refuses anything else."""
  url = store.url
  if not store.exists(MANIFEST):
    if store.exists("plan.json"):
      raise ValueError(f"data.corpus={url!r} is a half-written prepared dataset (no "
                       f"{MANIFEST}; its prepare did not finish): run that prepare again to "
                       "resume it, then use its output directory")
    raise ValueError(f"data.corpus={url!r}: not a prepared dataset (no {MANIFEST})")
  try:
    manifest = json.loads(store.read(MANIFEST))
  except ValueError as e:
    raise ValueError(f"data.corpus={url!r}: {MANIFEST} is not JSON ({e}): damaged?") from None
  if manifest.get("format") != FORMAT or manifest.get("complete") is not True:
    raise ValueError(f"data.corpus={url!r}: {MANIFEST} is not a complete {FORMAT} "
                     f"manifest (format {manifest.get('format')!r}, complete "
                     f"{manifest.get('complete')!r})")
  sizes = store.sizes("shards")
  itemsize = np.dtype(manifest["dtype"]).itemsize
  for split in SPLITS.values():
    for shard in manifest["splits"][split]["shards"]:
      want = {"tokens": shard["tokens"] * itemsize, "starts": shard["documents"] * 8,
              "bytes": shard["documents"] * 8}
      for kind, size in want.items():
        name = f"{shard['name']}.{kind}"
        if sizes.get(name) != size:
          raise ValueError(f"data.corpus={url!r}: shards/{name} has "
                           f"{sizes.get(name, 'no')} bytes, the manifest says {size}: the "
                           "dataset is incomplete or damaged; prepare it again")
  return manifest


class PreparedStream:
  """One split of a prepared dataset as a token stream: `read(start, stop)` ->
  (tokens, whether each begins a document), what packing.pack_window reads."""

  def __init__(self, store: Store, manifest: dict, split: str):
    self.store, self.dtype = store, manifest["dtype"]
    info = manifest["splits"][split]
    self.shards = [s["name"] for s in info["shards"]]
    self.lengths = [int(s["tokens"]) for s in info["shards"]]
    self.counts = [int(s["documents"]) for s in info["shards"]]
    self.offsets = np.cumsum([0] + self.lengths)
    self.total_bytes = int(info["bytes"])
    self.documents = int(info["documents"])
    self.names = [f"{store.url} ({split}: {self.documents} documents)"]

  def __len__(self) -> int:
    return int(self.offsets[-1])

  def _cached(self, key: tuple, build):
    """This stream's shard arrays, opened (local) or fetched (remote) once while among
    its CACHED most recent; not pickled (a grain worker opens its own)."""
    cache = self.__dict__.setdefault("_cache", collections.OrderedDict())
    if key in cache:
      cache.move_to_end(key)
      return cache[key]
    cache[key] = value = build()
    if len(cache) > CACHED:
      cache.popitem(last=False)
    return value

  def _tokens(self, i: int):
    return self._cached(("tokens", i), lambda: self.store.array(
        f"shards/{self.shards[i]}.tokens", self.dtype, self.lengths[i]))

  def starts(self, i: int) -> np.ndarray:
    return self._cached(("starts", i), lambda: np.asarray(self.store.array(
        f"shards/{self.shards[i]}.starts", "<i8", self.counts[i])[:self.counts[i]]))

  def __getstate__(self):
    return {k: v for k, v in self.__dict__.items() if k != "_cache"}

  def doc_bytes(self, i: int) -> np.ndarray:
    return np.asarray(self.store.array(f"shards/{self.shards[i]}.bytes", "<i8",
                                       self.counts[i])[:self.counts[i]])

  def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    if not 0 <= start <= stop <= len(self):
      raise IndexError(f"read [{start}, {stop}) outside stream of length {len(self)}")
    toks, new = [np.zeros([0], np.int64)], [np.zeros([0], bool)]
    i = int(np.searchsorted(self.offsets, start, side="right")) - 1
    a = start
    while a < stop:
      lo = int(self.offsets[i])
      b = min(stop, int(self.offsets[i + 1]))
      toks.append(np.asarray(self._tokens(i)[a - lo:b - lo], np.int64))
      starts = self.starts(i)
      flags = np.zeros([b - a], bool)
      j0, j1 = np.searchsorted(starts, [a - lo, b - lo])
      flags[starts[j0:j1] - (a - lo)] = True
      new.append(flags)
      a, i = b, i + 1
    return np.concatenate(toks), np.concatenate(new)


def dataset_tokenizer(store: Store, manifest: dict) -> Tokenizer:
  """The tokenizer the dataset was prepared with, from its tokenizer/ directory."""
  kind = manifest["tokenizer"]["kind"]
  if kind == "byte":
    return ByteTokenizer()
  if kind == "sentencepiece":
    return SentencePieceTokenizer(store.read(SPM_FILE))
  side = {f: json.loads(store.read(f"tokenizer/{f}")) for f in (*HF_FILES[1:], "config.json")
          if store.exists(f"tokenizer/{f}")}
  return HFTokenizer(store.read("tokenizer/tokenizer.json").decode("utf-8"),
                     side.get("tokenizer_config.json"), side.get("config.json"))


def check_tokenizer(tok: Tokenizer, manifest: dict, url: str, what: str) -> None:
  """Refuses a tokenizer other than the dataset's, naming both fingerprints."""
  m = manifest["tokenizer"]
  require_tokenizer(tok, m["fingerprint"], lambda got, want: (
      f"{what} gives tokenizer {got}, but the prepared dataset {url!r} was tokenized with "
      f"{want} ({m['kind']}, vocabulary {m['vocab_size']}): its token ids would mean other "
      f"text. Use the dataset's: --config.data.tokenizer={m['kind']} "
      f"--config.data.vocab_size={m['vocab_size']} (and a new --workdir if this run "
      "cached another)"))


def validation_stream(url: str, tok: Tokenizer, what: str) -> PreparedStream:
  """The validation split of the dataset at `url`, which `tok` must have tokenized."""
  store = Store(url)
  manifest = open_manifest(store)
  check_tokenizer(tok, manifest, url, what)
  return PreparedStream(store, manifest, SPLITS["val"])


def run_tokenizer(data_cfg, workdir: str | None, store: Store, manifest: dict,
                  cache: bool) -> Tokenizer:
  """The run's tokenizer, which must be the dataset's: a run's cached one, a given
  data.spm_model / hf:PATH, else (data.tokenizer "sentencepiece" / "hf") the
  dataset's own, cached into the run. Refuses a mismatch, naming both fingerprints."""
  kind = data_cfg.tokenizer
  own = kind in ("sentencepiece", "hf") and not (kind == "sentencepiece" and
                                                  data_cfg.spm_model)
  cached = workdir and os.path.isfile(os.path.join(
      workdir, SPM_FILE if kind == "sentencepiece" else "tokenizer/tokenizer.json"))
  if own and not cached and manifest["tokenizer"]["kind"] == kind:
    tok = dataset_tokenizer(store, manifest)
    if tok.vocab_size != int(data_cfg.vocab_size):
      raise ValueError(f"data.vocab_size={data_cfg.vocab_size} but the prepared dataset "
                       f"{store.url!r} has a {tok.vocab_size}-token tokenizer: set "
                       f"--config.data.vocab_size={tok.vocab_size}")
    if cache and workdir:
      tok.save(os.path.join(workdir, SPM_FILE) if kind == "sentencepiece"
               else os.path.join(workdir, "tokenizer"))
  else:
    tok = load_tokenizer(data_cfg, workdir, cache=cache)
  check_tokenizer(tok, manifest, store.url, f"data.tokenizer={kind!r}")
  return tok


def open_dataset(url: str, data_cfg, workdir: str | None, cache: bool = True,
                 expect: str | None = None):
  """(tokenizer, train stream, validation stream, info) of the prepared dataset at `url`.
  `expect`: the tokenizer fingerprint the run recorded (config.json's `_run.data`)."""
  store = Store(url)
  manifest = open_manifest(store)
  with staging.staged(workdir, HF_DIR) as local:  # A bucket run: a local copy of tokenizer/.
    tok = run_tokenizer(data_cfg, local, store, manifest, cache)
  got = require_tokenizer(tok, expect, lambda got, want: (
      f"data.corpus={url!r} was tokenized with {got}, but the run in {workdir} was trained "
      f"with {want} (its config.json): its token ids would mean other text; train on a "
      "dataset prepared with the run's tokenizer, or start a new --workdir"))
  train, val = (PreparedStream(store, manifest, s) for s in SPLITS.values())
  info = {"corpus": url, "tokenizer": data_cfg.tokenizer,
          "tokenizer_fingerprint": got, "vocab_size": tok.vocab_size,
          "train_tokens": len(train), "val_tokens": len(val), "val_documents": val.documents,
          "train_bytes": int(manifest["splits"][SPLITS["train"]]["bytes"]),
          "prepared": {k: manifest[k] for k in ("created", "command")}}
  return tok, train, val, info

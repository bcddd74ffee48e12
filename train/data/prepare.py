"""Prepare once: a corpus tokenized into a prepared dataset that runs read as is.

    python launch.py --mode prepare --input 'corpus/*.jsonl.zst' --output prepared/web \\
        --config.data.tokenizer=sentencepiece --config.data.vocab_size=8192
    from train.data.prepare import prepare
    manifest = prepare(["corpus/*.jsonl"], "prepared/web", tokenizer="byte")

A prepared dataset OUT holds:
  manifest.json   what is here: sources (sizes, sha256), tokenizer fingerprint, counts
                  per split, skipped records, the command; written last
  tokenizer/      spm.model or tokenizer.json (+ side files): what the token ids mean
  shards/SPLIT-NNNNN.tokens  token ids (uint8, uint16 or uint32: the smallest that holds
                  the vocabulary) of source NNNNN's documents in SPLIT ("train" |
                  "validation"), each ending in EOS if the tokenizer has one
  shards/SPLIT-NNNNN.starts  int64: where each document starts in that shard
  shards/SPLIT-NNNNN.bytes   int64: each document's UTF-8 bytes

Everything is written under OUT.partial/ and renamed to OUT once complete, manifest
included: readers (train/data/prepared.py) refuse a directory without one. A killed
or failed prepare leaves OUT.partial/ with plan.json and ledger.jsonl (the sources
finished); the same command resumes after them, a different one is refused. Both are
removed from OUT once it is complete.
Formats: train/data/formats.py; per-document work: train/data/prepare_work.py.
"""

from __future__ import annotations

import collections
import datetime
import json
import logging
import multiprocessing
import os
import sys

from train.data import prepare_work
from train.data.formats import InputFile, PrepareError, Reader, find_sources
from train.data.prepare_out import (LEDGER, Progress, ShardWriter, append_ledger, read_ledger,
                                    sync_json)
from train.data.prepare_tok import parse_tokenizer_from, plan_tokenizer
from train.data.tokenizers import fingerprint

MANIFEST = "manifest.json"
FORMAT = "blockwork-prepared/1"
SPLITS = prepare_work.SPLITS
log = logging.getLogger(__name__)


def default_workers() -> int:
  return max(1, (os.cpu_count() or 2) - 1)


def prepare(inputs: list[str] | str, out: str, *, tokenizer: str = "byte",
            vocab_size: int = 8192, spm_model: str = "", text_field: str = "text",
            id_field: str = "", val_fraction: float = 0.01, skip_bad_records: bool = False,
            workers: int | None = None, sample_bytes: int = 64 << 20,
            command: list[str] | None = None, progress: bool = True,
            tokenizer_from: str = "") -> dict:
  """Prepares `inputs` (files, directories, globs, a saved HF dataset, "hf:NAME") into
  `out` and returns its manifest. `tokenizer`: "byte", "sentencepiece" (`spm_model`, or
  one trained on at most `sample_bytes` of train documents: an equal share from the
  start of each source) or "hf:PATH". `workers`: tokenizing processes (0: this one).
  `tokenizer_from`: "NAME=INPUT:WEIGHT,...", train the SentencePiece model on those
  datasets instead, each sampled by its weight (prepare_tok.py): one tokenizer for a
  mixture, which the other datasets' prepares reuse through `spm_model`."""
  inputs = [inputs] if isinstance(inputs, str) else list(inputs)
  out = os.path.abspath(os.path.expanduser(out))
  if not 0.0 < val_fraction < 1.0:
    raise PrepareError(f"val_fraction={val_fraction}: must be in (0, 1)")
  if os.path.isfile(os.path.join(out, MANIFEST)):
    raise PrepareError(f"{out} is already a prepared dataset (it has a {MANIFEST}); "
                       "prepare into a new directory, or remove it first")
  if os.path.exists(out):
    raise PrepareError(f"{out} exists and is not a prepared dataset: prepare never writes "
                       "into a directory it did not make")
  sources = find_sources(inputs)
  from_datasets = parse_tokenizer_from(tokenizer_from) if tokenizer_from else []
  if from_datasets and (tokenizer != "sentencepiece" or spm_model):
    raise PrepareError("--tokenizer_from trains a SentencePiece model: it needs "
                       "tokenizer='sentencepiece' and no spm_model (a given model is used "
                       f"as it is); got tokenizer={tokenizer!r}, spm_model={spm_model!r}")
  partial = out + ".partial"
  options = {"tokenizer": tokenizer, "vocab_size": int(vocab_size), "spm_model": spm_model,
             "text_field": text_field, "id_field": id_field, "val_fraction": val_fraction,
             "skip_bad_records": bool(skip_bad_records), "sample_bytes": int(sample_bytes),
             **({"tokenizer_from": from_datasets} if from_datasets else {})}
  plan = {"format": FORMAT, "inputs": inputs, "options": options}
  done = _open_partial(partial, plan, sources)
  settings = dict(text_field=text_field, id_field=id_field, val_fraction=val_fraction,
                  skip_bad=bool(skip_bad_records))
  tok = plan_tokenizer(options, partial, sources, settings)
  dtype = next(t for t, n in (("uint8", 1 << 8), ("uint16", 1 << 16), ("uint32", 1 << 32))
               if tok.vocab_size <= n)
  s = prepare_work.Settings(**settings, tokenizer=prepare_work.tokenizer_spec(tok), dtype=dtype)
  workers = default_workers() if workers is None else int(workers)
  todo = [i for i in range(len(sources)) if i not in done]
  if done:
    log.info("resuming the prepare of %s: %d of %d sources already done", out, len(done),
             len(sources))
  bar = Progress(sum(sources[i].size for i in todo), len(sources), len(done), progress)
  with _Workers(workers, s) as run:
    _prepare_sources(run, sources, todo, partial, s, bar, done)
  bar.close()
  manifest = _manifest(sources, done, tok, dtype, options, command)
  sync_json(os.path.join(partial, MANIFEST), manifest)
  os.rename(partial, out)  # The commit: OUT appears complete, or not at all.
  # The resume state: a finished dataset needs neither (readers read manifest.json;
  # plan.json marks a half-written OUT.partial/ for them).
  for leftover in (os.path.join(out, f) for f in (LEDGER, "plan.json")):
    if os.path.exists(leftover):
      os.remove(leftover)
  return manifest


def _open_partial(partial: str, plan: dict, sources: list[InputFile]) -> dict[int, dict]:
  """Starts OUT.partial/, or resumes one made by the same command: {source index:
  ledger entry} of the sources it finished. Refuses another command's, or one whose
  finished sources changed on disk since."""
  plan_path = os.path.join(partial, "plan.json")
  if not os.path.isdir(partial):
    os.makedirs(os.path.join(partial, "shards"))
    sync_json(plan_path, plan)
    return {}
  try:
    with open(plan_path) as f:
      old = json.load(f)
  except (OSError, ValueError):
    old = None
  if old != json.loads(json.dumps(plan)):
    raise PrepareError(
        f"{partial} holds an unfinished prepare with other inputs or options ({plan_path}: "
        f"{old}); run that command again to resume it, or remove {partial} to start over")
  by_rel = {s.rel: (i, s) for i, s in enumerate(sources)}
  done = {}
  for entry in read_ledger(partial):
    i, src = by_rel.get(entry["rel"], (None, None))
    if src is None or i != entry["source"] or (src.size, src.mtime) != (entry["size"],
                                                                        entry["mtime"]):
      raise PrepareError(f"{entry['rel']} changed (or moved) since {partial} prepared it; "
                         f"remove {partial} to prepare everything again")
    done[i] = entry
  return done


class _Workers:
  """Tokenizing processes, fed a bounded window of chunks in order (memory stays
  bounded by the window, whatever the corpus size); `workers=0`: in this process."""

  def __init__(self, workers: int, settings):
    self.workers, self.settings, self.pool = workers, settings, None

  def __enter__(self):
    if self.workers > 0:
      ctx = multiprocessing.get_context("spawn")  # JAX may run threads here: never fork.
      self.pool = ctx.Pool(self.workers, prepare_work.init, (self.settings,))
    else:
      prepare_work.init(self.settings)
    return self

  def __exit__(self, *exc):
    if self.pool is not None:
      (self.pool.close if exc[0] is None else self.pool.terminate)()
      self.pool.join()

  def __call__(self, chunks):
    if self.pool is None:
      yield from map(prepare_work.process, chunks)
      return
    pending = collections.deque()
    for chunk in chunks:
      pending.append(self.pool.apply_async(prepare_work.process, (chunk,)))
      if len(pending) >= 2 * self.workers + 2:
        yield pending.popleft().get()
    while pending:
      yield pending.popleft().get()


class _Source:
  """One source being written: its reader, its shards, what it skipped."""

  def __init__(self, src: InputFile, index: int, partial: str, s):
    self.src, self.index, self.partial = src, index, partial
    self.reader = Reader(src, index, s.text_field, s.id_field)
    self.writer = ShardWriter(os.path.join(partial, "shards"), index, s.dtype)
    self.skipped = collections.Counter()

  def finish(self, bar) -> dict:
    """Flushes its shards and appends its ledger entry (the file is then done)."""
    bar.source_done(self.src.size)
    entry = {"source": self.index, "rel": self.src.rel, "path": self.src.path,
             "kind": self.src.kind, "size": self.src.size, "mtime": self.src.mtime,
             "sha256": self.reader.sha256, "splits": self.writer.close(),
             "skipped": dict(self.skipped)}
    append_ledger(self.partial, entry)
    return entry


def _prepare_sources(run, sources, todo: list[int], partial: str, s, bar,
                     done: dict[int, dict]) -> None:
  """Tokenizes the `todo` sources into their shards, adding each one's ledger entry
  to `done` as it completes. The chunks of all sources flow through the workers
  back to back (results come in order), so many small files keep them busy too."""
  if not todo:
    return
  open_ = {i: _Source(sources[i], i, partial, s) for i in todo}  # Readers open lazily.
  chunks = (chunk for i in todo for chunk in open_[i].reader)
  k = 0
  for result in run(chunks):
    while result["source"] != todo[k]:  # Its reader is exhausted: the source is done.
      done[todo[k]] = open_.pop(todo[k]).finish(bar)
      k += 1
    current = open_[todo[k]]
    if result["error"]:
      current.writer.close()
      raise PrepareError(result["error"])
    current.skipped.update(result["skipped"])
    current.writer.add(result["splits"])
    bar.update(result["offset"], result["text_bytes"], current.writer.documents,
               current.writer.tokens)
  for i in todo[k:]:  # The last source, and any that gave no chunk (empty files).
    done[i] = open_.pop(i).finish(bar)


def _manifest(sources, done: dict[int, dict], tok, dtype: str, options: dict,
              command) -> dict:
  splits = {k: {"tokens": 0, "documents": 0, "bytes": 0, "shards": []} for k in SPLITS}
  skipped = collections.Counter()
  for i in range(len(sources)):
    entry = done[i]
    skipped.update(entry["skipped"])
    for k in SPLITS:
      shard = entry["splits"][k]
      if shard["documents"]:
        splits[k]["shards"].append({"name": f"{k}-{i:05d}", **shard})
        for field in ("tokens", "documents", "bytes"):
          splits[k][field] += shard[field]
  for k in SPLITS:
    if not splits[k]["documents"]:
      raise PrepareError(
          f"no document landed in the {k} split ({sum(s['documents'] for s in splits.values())}"
          f" documents in all, val_fraction={options['val_fraction']}): prepare more "
          f"documents or change val_fraction (in a new output, or after removing the "
          f".partial directory)")
  return {
      "format": FORMAT, "complete": True, "dtype": dtype,
      "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "command": list(command) if command is not None else list(sys.argv),
      "tokenizer": {"kind": tok.identity()[0], "fingerprint": fingerprint(tok),
                    "vocab_size": int(tok.vocab_size), "eos_id": tok.eos_id,
                    "dir": "tokenizer"},
      "splits": splits, "skipped": dict(skipped), "options": options,
      "sources": [{k: done[i][k] for k in ("rel", "path", "kind", "size", "sha256")}
                  | {"documents": sum(done[i]["splits"][k]["documents"] for k in SPLITS),
                     "skipped": done[i]["skipped"]} for i in range(len(sources))],
  }


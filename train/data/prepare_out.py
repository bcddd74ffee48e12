"""What prepare writes as it goes: one source's shards, the ledger, the progress line."""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

LEDGER = "ledger.jsonl"
SHARD_FILES = ("tokens", "starts", "bytes")  # shards/SPLIT-NNNNN.<one of these>


def sync_json(path: str, obj) -> None:
  """Writes `obj` to `path` atomically and durably (a crash leaves the old file or the new)."""
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def read_ledger(partial: str) -> list[dict]:
  """Finished sources; a line cut by a crash (the last) is ignored: that source reruns."""
  path = os.path.join(partial, LEDGER)
  if not os.path.exists(path):
    return []
  out = []
  with open(path) as f:
    for line in f:
      try:
        out.append(json.loads(line))
      except ValueError:
        break
  return out


def append_ledger(partial: str, entry: dict) -> None:
  with open(os.path.join(partial, LEDGER), "a") as f:
    f.write(json.dumps(entry) + "\n")
    f.flush()
    os.fsync(f.fileno())


class ShardWriter:
  """Appends tokenized chunks of one source to its shards (train and validation);
  `close` flushes them to disk and returns their counts. Files are opened "wb": a
  source that a killed prepare left half-written starts over."""

  def __init__(self, directory: str, index: int, dtype: str):
    self.directory, self.index, self.dtype = directory, index, dtype
    self.files, self.counts = {}, {}
    self.documents = self.tokens = 0

  def _open(self, split: str):
    if split not in self.files:
      self.files[split] = {
          kind: open(os.path.join(self.directory, f"{split}-{self.index:05d}.{kind}"), "wb")
          for kind in SHARD_FILES}
      self.counts[split] = {"tokens": 0, "documents": 0, "bytes": 0}
    return self.files[split], self.counts[split]

  def add(self, splits: dict) -> None:
    for split, (tokens, lengths, nbytes) in splits.items():
      if not len(lengths):
        continue
      files, counts = self._open(split)
      starts = counts["tokens"] + np.concatenate([[0], np.cumsum(lengths)[:-1]])
      files["tokens"].write(np.ascontiguousarray(tokens, self.dtype).tobytes())
      files["starts"].write(starts.astype("<i8").tobytes())
      files["bytes"].write(nbytes.astype("<i8").tobytes())
      counts["tokens"] += len(tokens)
      counts["documents"] += len(lengths)
      counts["bytes"] += int(nbytes.sum())
      self.documents += len(lengths)
      self.tokens += len(tokens)

  def close(self) -> dict:
    for files in self.files.values():
      for f in files.values():
        f.flush()
        os.fsync(f.fileno())
        f.close()
    empty = {"tokens": 0, "documents": 0, "bytes": 0}
    return {split: self.counts.get(split, dict(empty)) for split in ("train", "validation")}


def _duration(seconds: float) -> str:
  seconds = int(seconds)
  if seconds >= 3600:
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
  return f"{seconds // 60}m{seconds % 60:02d}s"


class Progress:
  """The progress line on stderr (every 2 s, and at the end): files, documents, tokens,
  the documents' text MB (uncompressed UTF-8) and their rate, the input MB done (the
  files' own bytes, compressed or not), and the ETA: the time so far scaled by the input
  bytes left over those done, counting only chunks tokenized (not read ahead)."""

  def __init__(self, total_bytes: int, num_sources: int, sources_done: int, enabled: bool):
    self.total, self.enabled = max(total_bytes, 1), enabled
    self.num_sources, self.sources_done = num_sources, sources_done
    self.finished_bytes = self.current = 0
    self.docs = self.tokens = self.text = 0
    self.prior_docs = self.prior_tokens = 0
    self.t0 = self.last = time.monotonic()

  def update(self, source_bytes: int, text_bytes: int, docs: int, tokens: int) -> None:
    """A chunk tokenized: its source's input bytes done so far, its text's bytes, and the
    source's documents and tokens so far."""
    self.current = source_bytes
    self.text += text_bytes
    self.docs, self.tokens = self.prior_docs + docs, self.prior_tokens + tokens
    if time.monotonic() - self.last >= 2.0:
      self.show()

  def source_done(self, size: int) -> None:
    self.finished_bytes += size
    self.current = 0
    self.sources_done += 1
    self.prior_docs, self.prior_tokens = self.docs, self.tokens

  # The share of the input done before an ETA is printed: the first chunks also pay the
  # start-up (workers, tokenizer), and an 18 s job once printed "ETA 10m02s" from them.
  MIN_MEASURED = 0.05

  def eta(self) -> float | None:
    """Seconds left: elapsed x input bytes left / input bytes done; None until
    MIN_MEASURED of the input is done (too little measured to extrapolate)."""
    done = min(self.finished_bytes + self.current, self.total)
    if done < self.MIN_MEASURED * self.total:
      return None
    elapsed = time.monotonic() - self.t0
    return elapsed * (self.total - done) / done

  def show(self, end: str = "") -> None:
    self.last = time.monotonic()
    if not self.enabled:
      return
    done = min(self.finished_bytes + self.current, self.total)
    elapsed = time.monotonic() - self.t0
    rate = self.text / 1e6 / max(elapsed, 1e-9)
    if end:  # The last line: how long it took, not how long is left.
      when = f"done in {_duration(elapsed)}"
    else:
      eta = self.eta()
      when = "ETA (measuring)" if eta is None else f"ETA {_duration(eta)}"
    print(f"prepare: {self.sources_done}/{self.num_sources} files  {self.docs:,} docs  "
          f"{self.tokens / 1e6:,.1f}M tokens  {self.text / 1e6:,.1f} MB text ({rate:.1f} "
          f"MB/s)  input {done / 1e6:,.1f}/{self.total / 1e6:,.1f} MB  {when}",
          file=sys.stderr, flush=True)

  def close(self) -> None:
    self.show(end="done")

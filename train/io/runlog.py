"""The append-only logs of a run (metrics.jsonl, metrics.rewound.jsonl,
config_changes.jsonl, evals.jsonl): JSON lines, read back as one stream in order.

In a local run directory a log is one file, appended to (the public format of
metrics.jsonl). On object storage, where an object cannot be appended to, a log is the
prefix `RUN/<name>.parts/`: each append creates one new segment object
(`00000001.jsonl`, `00000002.jsonl`, ...), created if absent (train/io/conditional.py: never
rewritten, so two writers never replace each other's segment, and a retried create whose
first request landed is not written twice), and the readers concatenate them in order.

A resume that rewinds metrics.jsonl to its checkpoint's step S (lines logged after the
last checkpoint, by an attempt that was killed) rewrites the local file without them
(train/metrics.py `truncate_after`); on a bucket it appends a marker segment
`{"_rewind_to": S}` instead, and the readers drop the lines before the marker whose step
is past S: the same stream as the local file, nothing lost or read twice.
"""

from __future__ import annotations

import json
import logging

from train.io import conditional, storage

log = logging.getLogger(__name__)

PARTS = ".parts"  # RUN/metrics.jsonl.parts/00000001.jsonl on object storage.
REWIND = "_rewind_to"


def parts_dir(workdir: str, name: str) -> str:
  return storage.join(workdir, name + PARTS)


def _segments(workdir: str, name: str) -> list[str]:
  return [n for n in storage.listdir(parts_dir(workdir, name))
          if n.endswith(".jsonl") and n[:-len(".jsonl")].isdigit()]


def exists(workdir: str, name: str) -> bool:
  if storage.is_url(workdir):
    return bool(_segments(workdir, name))
  return storage.exists(storage.join(workdir, name))


def read_lines(workdir: str, name: str) -> list[tuple[str, str]]:
  """(where, line) for every line of the log in order: where names the file or segment."""
  if not storage.is_url(workdir):
    path = storage.join(workdir, name)
    if not storage.exists(path):
      return []
    text = storage.read_bytes(path).decode("utf-8", errors="replace")
    return [(path, line) for line in text.splitlines()]
  paths = [storage.join(parts_dir(workdir, name), seg) for seg in _segments(workdir, name)]
  return [(path, line) for path, data in zip(paths, storage.read_many(paths))
          for line in data.decode("utf-8", errors="replace").splitlines()]


def read_records(workdir: str, name: str, warn: bool = True) -> list[dict]:
  """The JSON objects of the log in order. A line that is not JSON (the last one cut
  by a crash mid-write, typically) is skipped with a warning naming it."""
  lines = read_lines(workdir, name)
  out = []
  for i, (where, line) in enumerate(lines, 1):
    line = line.strip()
    if not line:
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      if warn:
        at = "the last line" if i == len(lines) else f"line {i} of {len(lines)}"
        log.warning("%s: %s is not JSON (cut by a crash mid-write?); skipped: %.80r",
                    where, at, line)
      continue
    if isinstance(record, dict) and REWIND in record:
      out = [r for r in out if r.get("step", 0) <= record[REWIND]]
    else:
      out.append(record)
  return out


class Log:
  """Appends to one log of a run directory; on a bucket, one segment per `append`."""

  def __init__(self, workdir: str, name: str):
    self.workdir, self.name = workdir, name
    self.next = None  # The next segment's number (listed once, on the first append).

  def append(self, lines: list[str]) -> None:
    """`lines`, each ending in "\\n", written at once."""
    if not lines:
      return
    text = "".join(lines)
    if not storage.is_url(self.workdir):
      self._append_local(text)
      return
    data = text.encode("utf-8")
    for _ in range(100):
      if self.next is None:
        segs = _segments(self.workdir, self.name)
        self.next = int(segs[-1][:-len(".jsonl")]) + 1 if segs else 1
      path = storage.join(parts_dir(self.workdir, self.name), f"{self.next:08d}.jsonl")
      self.next += 1
      if conditional.create_exclusive(path, data):
        return
      self.next = None  # Another writer took that number: list again.
    raise storage.StorageError("append", parts_dir(self.workdir, self.name),
                               "100 segment numbers were taken while appending")

  def _append_local(self, text: str) -> None:
    path = storage.join(self.workdir, self.name)
    with open(path, "a+b") as f:
      cut = False
      if f.seek(0, 2) > 0:
        f.seek(-1, 2)
        cut = f.read(1) != b"\n"
      # A line cut by a crash stays visible as itself; the new line starts afresh.
      f.write((("\n" if cut else "") + text).encode())

  def rewind(self, step: int) -> None:
    """Bucket only: the readers drop the lines so far whose step is past `step`."""
    self.append([json.dumps({REWIND: step}) + "\n"])


def append(workdir: str, name: str, lines: list[str]) -> None:
  Log(workdir, name).append(lines)


def replace(workdir: str, name: str, lines: list[str]) -> None:
  """The log holds `lines` only (an evaluation directory's metrics.jsonl, written anew)."""
  if not storage.is_url(workdir):
    storage.write_text(storage.join(workdir, name), "".join(lines))
    return
  storage.delete(parts_dir(workdir, name), recursive=True)
  append(workdir, name, lines)

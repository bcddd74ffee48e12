"""Checksums of saved checkpoints: written when a save is final, verified on restore.

A checkpoint whose bytes changed on disk after it was saved (a flipped bit, a file
cut or overwritten) restores "fine" through orbax and trains on from damaged state.
`seal` records the size and a digest of every file of each finished checkpoint in
`checkpoints/<step>/CHECKSUMS.json`; `verify` compares them before a restore and
raises `CheckpointDamaged`, which the restore fallback (train/checkpoint.py) treats
like a checkpoint that fails to open. A checkpoint without the file (saved by an
older version, or killed between its save and its seal) is restored unverified.

Sealing reads nothing back (format 2):
- On a bucket the digests are the store's own, computed as the objects were written
  (train/io/store_checksums.py): one listing, a HeadObject per object on S3, one write.
- In a local directory each process checksums the files it wrote (its
  `ocdbt.process_<i>` shards; process 0 also the metadata) and process 0 merges the
  per-process manifests, gathered by a collective, into CHECKSUMS.json. A process that
  fails to checksum sends its error through the same collective, so every process
  raises it together rather than some waiting for the others (a process that dies or
  hangs outside the seal stalls the others until jax.distributed's heartbeat timeout).

CHECKSUMS.json: `{"format": 2, "files": {rel: {"size": n, <kind>: digest, "tag": t}}}`
(kinds: train/io/store_checksums.py). Format 1, `{"crc32": {rel: [size, crc]}, "tags":
{rel: t}}` (CRC-32s by a read-back), is still verified. `tag` is the object's content
tag in a listing (S3's ETag, GCS's md5Hash), which changes whenever the object is
rewritten: `verify` computes the recorded digest only for objects whose tag differs (a
copy of the run to another bucket may re-tag objects; a file has none), so an untouched
checkpoint in a bucket costs one listing, not a download, before its restore.
"""

from __future__ import annotations

import json
import re

import jax
import numpy as np

from train.io import storage, store_checksums

CHECKSUMS_FILE = "CHECKSUMS.json"
FORMAT = 2  # CHECKSUMS.json's "format"; format 1 had none.
_SHARD = re.compile(r"(?:^|/)ocdbt\.process_(\d+)/")  # Who wrote a file: its shard dir.


class CheckpointDamaged(ValueError):
  """A checkpoint's files differ from the checksums written when it was saved."""


def _broadcast(obj):
  """Process 0's JSON-able `obj`, on every process (a collective)."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
  n = int(multihost_utils.broadcast_one_to_all(np.array(len(data), np.int64)))
  if jax.process_index() != 0:
    data = np.zeros(n, np.uint8)
  return json.loads(bytes(np.asarray(multihost_utils.broadcast_one_to_all(data))))


def _gather(obj) -> list:
  """Every process's JSON-able `obj`, in process order, on every process (a collective)."""
  if jax.process_count() == 1:
    return [obj]
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.array(len(data), np.int64)))
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[:len(data)] = data
  got = np.asarray(multihost_utils.process_allgather(padded))
  return [json.loads(bytes(row[:int(n)])) for row, n in zip(got, sizes.reshape(-1))]


def _together() -> bool:
  return jax.process_count() > 1


def unsealed(checkpoint_dir: str, steps) -> list[int]:
  """The finished steps of `steps` without CHECKSUMS.json, as process 0 lists them ([]
  on the others): the steps to record and `seal`."""
  if jax.process_index() != 0:
    return []
  out = []
  for step in steps:
    found = storage.files(storage.join(checkpoint_dir, str(step)))
    if found and CHECKSUMS_FILE not in found:
      out.append(step)
  return out


def owner(rel: str) -> int:
  """The process that wrote a step's file: i for its `ocdbt.process_<i>` shards, 0 for
  the rest (metadata, markers; shards of a process index no longer present)."""
  m = _SHARD.search(rel.replace("\\", "/"))
  i = int(m.group(1)) if m else 0
  return i if i < jax.process_count() else 0


def _local_sums(step_dir: str) -> dict:
  """This process's part of a local step's manifest: {"files": ...} or {"error": ...}."""
  try:
    mine = {rel: size for rel, size in storage.files(step_dir).items()
            if owner(rel) == jax.process_index() and rel != CHECKSUMS_FILE}
    return {"files": {rel: {"size": size, "crc32": store_checksums.compute(
        storage.join(step_dir, rel), "crc32")} for rel, size in sorted(mine.items())}}
  except Exception as e:  # pylint: disable=broad-except  (sent to all, raised by all)
    return {"error": f"{type(e).__name__}: {e}"}


def _write(step_dir: str, files: dict) -> None:
  record = {"format": FORMAT, "files": dict(sorted(files.items()))}
  storage.write_text(storage.join(step_dir, CHECKSUMS_FILE), json.dumps(record))


def seal(checkpoint_dir: str, steps) -> None:
  """Writes CHECKSUMS.json into each finished step directory of `steps` that has none
  (`steps`: process 0's, from `unsealed`). Call on every process, when no save is in
  flight: in a local directory with several processes, each checksums its own files."""
  if storage.is_url(checkpoint_dir):
    for step in steps if jax.process_index() == 0 else []:
      step_dir = storage.join(checkpoint_dir, str(step))
      found = storage.listing(step_dir)
      if found and CHECKSUMS_FILE not in found:
        _write(step_dir, store_checksums.from_store(step_dir, found))
    return
  steps = [int(s) for s in steps if _unsealed_local(storage.join(checkpoint_dir, str(s)))]
  if _together():
    steps = _broadcast(steps if jax.process_index() == 0 else None)
  for step in steps:
    step_dir = storage.join(checkpoint_dir, str(step))
    parts = _gather(_local_sums(step_dir))
    errors = [f"process {i}: {p['error']}" for i, p in enumerate(parts) if "error" in p]
    if errors:
      raise OSError(f"checksums of checkpoint {step_dir} failed ({'; '.join(errors)}); "
                    "it stays unsealed (restored unverified) until the next seal")
    if jax.process_index() == 0:
      _write(step_dir, {rel: e for p in parts for rel, e in p["files"].items()})


def _unsealed_local(step_dir: str) -> bool:
  found = storage.files(step_dir) if jax.process_index() == 0 else {}
  return bool(found) and CHECKSUMS_FILE not in found


def _entries(record: dict) -> dict[str, dict]:
  """{rel: {"size", <kind>, "tag"?}} of a CHECKSUMS.json of either format."""
  if record.get("format") == FORMAT:
    return {rel: dict(e) for rel, e in record["files"].items()}
  if "format" in record:
    raise ValueError(f"format {record['format']!r} is not one this version reads "
                     f"(1, {FORMAT})")
  tags = record.get("tags", {})
  return {rel: {"size": size, "crc32": crc, **({"tag": tags[rel]} if rel in tags else {})}
          for rel, (size, crc) in record["crc32"].items()}


def _damage(step_dir: str) -> str | None:
  """What differs from the recorded checksums, or None (also when none are recorded)."""
  found = storage.files(step_dir)
  if CHECKSUMS_FILE not in found:
    return None
  try:
    entries = _entries(json.loads(storage.read_text(storage.join(step_dir, CHECKSUMS_FILE))))
    kinds = {rel: store_checksums.kind_of(e) for rel, e in entries.items()}
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    return f"its {CHECKSUMS_FILE} is not readable ({e})"
  tags = storage.content_tags(step_dir) if any("tag" in e for e in entries.values()) else {}
  for rel, entry in entries.items():
    if rel not in found:
      return f"{rel} is missing"
    if found[rel] != entry["size"]:
      return f"{rel} has {found[rel]} bytes, {entry['size']} when saved"
    if entry.get("tag") is not None and tags.get(rel) == entry["tag"]:
      continue  # The very object that was checksummed: not rewritten since.
    digest = store_checksums.compute(storage.join(step_dir, rel), kinds[rel])
    if digest != entry[kinds[rel]]:
      return f"{rel} differs from the checksum written when it was saved"
  return None


def verify(checkpoint_dir: str, step: int) -> None:
  """Raises CheckpointDamaged when checkpoint `step` differs from its checksums. Process
  0 reads the files; every process gets the same answer (restore is collective)."""
  step_dir = storage.join(checkpoint_dir, str(step))
  damage = _damage(step_dir) if jax.process_index() == 0 else None
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    bad = bool(multihost_utils.broadcast_one_to_all(np.array(damage is not None)))
    damage = damage or ("damaged (checked on process 0)" if bad else None)
  if damage:
    raise CheckpointDamaged(f"checkpoint {step_dir} is damaged: {damage}")

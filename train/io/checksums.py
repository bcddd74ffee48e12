"""Checksums of saved checkpoints: written when a save is final, verified on restore.

A checkpoint whose bytes changed on disk after it was saved (a flipped bit, a file
cut or overwritten) restores "fine" through orbax and trains on from damaged state.
`seal` records the size and CRC-32 of every file of each finished checkpoint in
`checkpoints/<step>/CHECKSUMS.json`; `verify` compares them before a restore and
raises `CheckpointDamaged`, which the restore fallback (train/checkpoint.py) treats
like a checkpoint that fails to open. A checkpoint without the file (saved by an
older version, or killed between its save and its seal) is restored unverified.

Every file is read through train/io/storage.py, so a checkpoint in a bucket is checked
the same way (one listing of the step's objects, then ranged reads). There the record
also keeps each object's content tag from the listing (S3's ETag, GCS's md5Hash),
which changes whenever the object is rewritten: `verify` reads back only the objects
whose tag differs (a copy of the run to another bucket may re-tag objects), so an
untouched checkpoint costs one listing, not a second download, before its restore.
"""

from __future__ import annotations

import json
import zlib

import jax
import numpy as np

from train.io import storage

CHECKSUMS_FILE = "CHECKSUMS.json"
_CHUNK = 1 << 22  # Bytes read at once from a file,
_OBJECT_CHUNK = 1 << 26  # and from an object (a request each: fewer, larger ones).


class CheckpointDamaged(ValueError):
  """A checkpoint's files differ from the checksums written when it was saved."""


def _crc32(path: str) -> int:
  crc = 0
  for chunk in storage.read_chunks(path, _OBJECT_CHUNK if storage.is_url(path) else _CHUNK):
    crc = zlib.crc32(chunk, crc)
  return crc


def unsealed(checkpoint_dir: str, steps) -> list[int]:
  """The finished steps of `steps` without CHECKSUMS.json (process 0; [] elsewhere)."""
  if jax.process_index() != 0:
    return []
  out = []
  for step in steps:
    found = storage.files(storage.join(checkpoint_dir, str(step)))
    if found and CHECKSUMS_FILE not in found:
      out.append(step)
  return out


def seal(checkpoint_dir: str, steps) -> None:
  """Writes CHECKSUMS.json into each finished step directory that has none (process 0;
  call only when no save is in flight)."""
  if jax.process_index() != 0:
    return
  for step in steps:
    step_dir = storage.join(checkpoint_dir, str(step))
    found = storage.files(step_dir)
    if not found or CHECKSUMS_FILE in found:
      continue
    sums = {rel: [size, _crc32(storage.join(step_dir, rel))]
            for rel, size in sorted(found.items())}
    record = {"crc32": sums}
    if tags := storage.content_tags(step_dir):
      record["tags"] = {rel: tags[rel] for rel in sums if rel in tags}
    storage.write_text(storage.join(step_dir, CHECKSUMS_FILE), json.dumps(record))


def _damage(step_dir: str) -> str | None:
  """What differs from the recorded checksums, or None (also when none are recorded)."""
  found = storage.files(step_dir)
  if CHECKSUMS_FILE not in found:
    return None
  try:
    record = json.loads(storage.read_text(storage.join(step_dir, CHECKSUMS_FILE)))
    sums, saved_tags = record["crc32"], record.get("tags", {})
  except (OSError, ValueError, KeyError, TypeError, AttributeError):
    return f"its {CHECKSUMS_FILE} is not readable"
  tags = storage.content_tags(step_dir) if saved_tags else {}
  for rel, (size, crc) in sums.items():
    if rel not in found:
      return f"{rel} is missing"
    if found[rel] != size:
      return f"{rel} has {found[rel]} bytes, {size} when saved"
    if saved_tags.get(rel) is not None and tags.get(rel) == saved_tags[rel]:
      continue  # The very object that was checksummed: not rewritten since.
    if _crc32(storage.join(step_dir, rel)) != crc:
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

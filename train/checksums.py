"""Checksums of saved checkpoints: written when a save is final, verified on restore.

A checkpoint whose bytes changed on disk after it was saved (a flipped bit, a file
cut or overwritten) restores "fine" through orbax and trains on from damaged state.
`seal` records the size and CRC-32 of every file of each finished checkpoint in
`checkpoints/<step>/CHECKSUMS.json`; `verify` compares them before a restore and
raises `CheckpointDamaged`, which the restore fallback (train/checkpoint.py) treats
like a checkpoint that fails to open. A checkpoint without the file (saved by an
older version, or killed between its save and its seal) is restored unverified.
"""

from __future__ import annotations

import json
import os
import zlib

import jax
import numpy as np

CHECKSUMS_FILE = "CHECKSUMS.json"
_CHUNK = 1 << 22


class CheckpointDamaged(ValueError):
  """A checkpoint's files differ from the checksums written when it was saved."""


def _crc32(path: str) -> int:
  crc = 0
  with open(path, "rb") as f:
    while chunk := f.read(_CHUNK):
      crc = zlib.crc32(chunk, crc)
  return crc


def _files(step_dir: str) -> dict[str, str]:
  """{path relative to the step directory: absolute path} of the checkpoint's files."""
  out = {}
  for here, _, names in os.walk(step_dir):
    for name in names:
      path = os.path.join(here, name)
      rel = os.path.relpath(path, step_dir)
      if rel != CHECKSUMS_FILE:
        out[rel] = path
  return out


def seal(checkpoint_dir: str, steps) -> None:
  """Writes CHECKSUMS.json into each finished step directory that has none (process 0;
  call only when no save is in flight)."""
  if jax.process_index() != 0:
    return
  for step in steps:
    step_dir = os.path.join(checkpoint_dir, str(step))
    target = os.path.join(step_dir, CHECKSUMS_FILE)
    if not os.path.isdir(step_dir) or os.path.exists(target):
      continue
    sums = {rel: [os.path.getsize(p), _crc32(p)] for rel, p in sorted(_files(step_dir).items())}
    tmp = f"{target}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
      json.dump({"crc32": sums}, f)
    os.replace(tmp, target)


def _damage(step_dir: str) -> str | None:
  """What differs from the recorded checksums, or None (also when none are recorded)."""
  path = os.path.join(step_dir, CHECKSUMS_FILE)
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      sums = json.load(f)["crc32"]
  except (OSError, ValueError, KeyError, TypeError):
    return f"its {CHECKSUMS_FILE} is not readable"
  files = _files(step_dir)
  for rel, (size, crc) in sums.items():
    if rel not in files:
      return f"{rel} is missing"
    if os.path.getsize(files[rel]) != size:
      return f"{rel} has {os.path.getsize(files[rel])} bytes, {size} when saved"
    if _crc32(files[rel]) != crc:
      return f"{rel} differs from the checksum written when it was saved"
  return None


def verify(checkpoint_dir: str, step: int) -> None:
  """Raises CheckpointDamaged when checkpoint `step` differs from its checksums. Process
  0 reads the files; every process gets the same answer (restore is collective)."""
  step_dir = os.path.join(checkpoint_dir, str(step))
  damage = _damage(step_dir) if jax.process_index() == 0 else None
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    bad = bool(multihost_utils.broadcast_one_to_all(np.array(damage is not None)))
    damage = damage or ("damaged (checked on process 0)" if bad else None)
  if damage:
    raise CheckpointDamaged(f"checkpoint {step_dir} is damaged: {damage}")

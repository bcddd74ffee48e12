"""CHECKSUMS.json from the writers (train/io/checksums.py, train/io/store_checksums.py):
the store's own digests on a bucket, per-process CRC-32s merged by process 0 locally,
format 1 still verified, and a flipped bit found in every case."""

import base64
import hashlib
import json
import os
import zlib

import jax
import pytest

from train.io import checksums, storage, store_checksums
from train.io.checksums import CHECKSUMS_FILE, CheckpointDamaged

# A step's files as orbax lays them out with two processes (shards per process).
FILES = {
    "commit_success.txt": b"done",
    "state/_METADATA": b'{"tree": 1}',
    "state/ocdbt.process_0/d/aa": bytes(range(256)) * 40,
    "state/ocdbt.process_1/d/bb": bytes(range(255, -1, -1)) * 30,
    "data/data.json": b'{"index": 3}',
}


def _step(root: str, step: int = 3) -> str:
  step_dir = storage.join(root, str(step))
  for rel, data in FILES.items():
    storage.write_bytes(storage.join(step_dir, *rel.split("/")), data)
  return step_dir


def _record(step_dir: str) -> dict:
  return json.loads(storage.read_text(storage.join(step_dir, CHECKSUMS_FILE)))


def _flip(path: str, at: int = 100) -> None:
  blob = bytearray(storage.read_bytes(path))
  blob[at] ^= 0x10
  storage.write_bytes(path, bytes(blob))


def _rel(rel: str) -> str:
  return rel.replace("/", os.sep)


def test_a_local_step_is_sealed_with_crc32s_and_a_flipped_bit_is_found(tmp_path):
  step_dir = _step(str(tmp_path))
  checksums.seal(str(tmp_path), checksums.unsealed(str(tmp_path), [3]))
  record = _record(step_dir)
  assert record["format"] == checksums.FORMAT
  assert {rel: e["crc32"] for rel, e in record["files"].items()} == {
      _rel(rel): zlib.crc32(data) for rel, data in FILES.items()}
  checksums.verify(str(tmp_path), 3)
  _flip(os.path.join(step_dir, "state", "ocdbt.process_1", "d", "bb"))
  with pytest.raises(CheckpointDamaged, match="bb differs from the checksum"):
    checksums.verify(str(tmp_path), 3)


def test_each_process_checksums_its_own_shards_and_process_0_merges_them(
    tmp_path, monkeypatch):
  """Two processes simulated: each part holds only what its process wrote, and the
  merged manifest is the one a single process computes."""
  step_dir = _step(str(tmp_path))
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  parts = []
  for i in (0, 1):
    monkeypatch.setattr(jax, "process_index", lambda i=i: i)
    parts.append(checksums._local_sums(step_dir))  # pylint: disable=protected-access
  assert set(parts[1]["files"]) == {_rel("state/ocdbt.process_1/d/bb")}
  assert _rel("state/ocdbt.process_1/d/bb") not in parts[0]["files"]
  monkeypatch.setattr(jax, "process_index", lambda: 0)
  monkeypatch.setattr(checksums, "_broadcast", lambda steps: steps)
  monkeypatch.setattr(checksums, "_gather", lambda mine: [mine, parts[1]])
  checksums.seal(str(tmp_path), [3])
  assert {rel: e["crc32"] for rel, e in _record(step_dir)["files"].items()} == {
      _rel(rel): zlib.crc32(data) for rel, data in FILES.items()}


def test_a_process_that_fails_to_checksum_makes_every_process_raise(tmp_path, monkeypatch):
  """Its error travels through the gather: no process waits for it, none seals."""
  step_dir = _step(str(tmp_path))
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(checksums, "_broadcast", lambda steps: [3])
  monkeypatch.setattr(checksums, "_gather", lambda mine: [mine, {"error": "OSError: disk"}])
  for i in (0, 1):
    monkeypatch.setattr(jax, "process_index", lambda i=i: i)
    with pytest.raises(OSError, match="process 1: OSError: disk.*stays unsealed"):
      checksums.seal(str(tmp_path), [3] if i == 0 else [])
  assert not os.path.exists(os.path.join(step_dir, CHECKSUMS_FILE))


def _seal_v1(step_dir: str) -> None:
  """CHECKSUMS.json as format 1 wrote it: CRC-32s by a read-back, the listing's tags."""
  found = storage.files(step_dir)
  sums = {rel: [size, store_checksums.compute(storage.join(step_dir, rel), "crc32")]
          for rel, size in found.items()}
  record = {"crc32": sums}
  if tags := storage.content_tags(step_dir):
    record["tags"] = tags
  storage.write_text(storage.join(step_dir, CHECKSUMS_FILE), json.dumps(record))


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_step_sealed_by_format_1_still_verifies_and_its_damage_is_found(
    where, tmp_path, request):
  root = str(tmp_path) if where == "local" else request.getfixturevalue("s3_bucket") + "/ck"
  step_dir = _step(root)
  _seal_v1(step_dir)
  checksums.verify(root, 3)
  _flip(storage.join(step_dir, "state", "ocdbt.process_0", "d", "aa"))
  with pytest.raises(CheckpointDamaged, match="aa differs from the checksum"):
    checksums.verify(root, 3)


def test_s3_digests_come_from_heads_without_reading_an_object(s3_bucket, monkeypatch):
  root = f"{s3_bucket}/ck"
  step_dir = _step(root)
  reads = storage.REQUESTS["read"]
  checksums.seal(root, [3])
  assert storage.REQUESTS["read"] == reads
  files = _record(step_dir)["files"]
  for rel, data in FILES.items():  # The writer's CRC-32 (botocore sends one) or the MD5.
    entry = files[rel]
    assert entry.get("crc32", zlib.crc32(data)) == zlib.crc32(data)
    assert entry.get("md5", hashlib.md5(data).hexdigest()) == hashlib.md5(data).hexdigest()
  # Objects the store vouches for nothing about (multipart ETag, no checksum) are read.
  monkeypatch.setattr(storage, "s3_heads", lambda paths: [{"ETag": '"0123-2"'}] * len(paths))
  storage.delete(storage.join(step_dir, CHECKSUMS_FILE))
  checksums.seal(root, [3])
  assert _record(step_dir)["files"]["state/_METADATA"]["crc32"] == zlib.crc32(
      FILES["state/_METADATA"])
  assert storage.REQUESTS["read"] > reads


def test_s3_etag_md5_is_taken_unless_the_object_is_kms_encrypted():
  etag = '"' + hashlib.md5(b"x").hexdigest() + '"'
  assert store_checksums._s3({"ETag": etag}) == {  # pylint: disable=protected-access
      "md5": hashlib.md5(b"x").hexdigest()}
  assert store_checksums._s3({"ETag": etag, "ServerSideEncryption": "aws:kms"}) is None  # pylint: disable=protected-access
  crc = base64.b64encode(zlib.crc32(b"x").to_bytes(4, "big")).decode()
  assert store_checksums._s3({"ETag": '"ab-3"', "ChecksumCRC32": crc}) == {  # pylint: disable=protected-access
      "crc32": zlib.crc32(b"x")}


def test_gcs_digests_are_the_listings_md5_and_a_rewritten_object_is_checked(gcs_bucket):
  root = f"{gcs_bucket}/ck"
  step_dir = _step(root)
  reads = storage.REQUESTS["read"]
  checksums.seal(root, [3])
  assert storage.REQUESTS["read"] == reads
  files = _record(step_dir)["files"]
  assert {rel: files[rel]["md5"] for rel in FILES} == {
      rel: hashlib.md5(data).hexdigest() for rel, data in FILES.items()}
  checksums.verify(root, 3)
  _flip(storage.join(step_dir, "data", "data.json"), at=3)
  with pytest.raises(CheckpointDamaged, match="data.json differs"):
    checksums.verify(root, 3)

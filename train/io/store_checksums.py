"""The digests a checkpoint's CHECKSUMS.json records, and how each is computed again.

A record names one digest of an object's content, of one of three kinds, each computed
at restore from the bytes (`compute`) when the object may have changed:

  crc32    CRC-32 (zlib): a local file, checksummed by the process that wrote it; an S3
           object whose writer sent a full-object CRC-32 (`x-amz-checksum-crc32`)
  crc32c   CRC-32C (Castagnoli): a GCS object's `crc32c`; an S3 full-object CRC-32C
  md5      MD5, hex: a GCS object's `md5Hash`; an S3 object's ETag, which is the MD5 of
           its content for a single-part PUT without KMS / customer-key encryption

On a bucket the store computed them as the objects were written: `from_store` takes
them from one listing (GCS: its md5Hash / crc32c) or the listing and a HeadObject per
object (S3, no bytes), so sealing a step reads nothing back. An object for which the
store offers none (an S3 multipart upload without a full-object checksum, an SSE-KMS
ETag) is read back once for its CRC-32, the one case that costs a download.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import re
import zlib

from train.io import storage

log = logging.getLogger(__name__)

KINDS = ("crc32", "crc32c", "md5")
_CHUNK = 1 << 22  # Bytes read at once from a file,
_OBJECT_CHUNK = 1 << 26  # and from an object (a request each: fewer, larger ones).
_MD5_ETAG = re.compile(r"[0-9a-f]{32}")
_KMS = ("aws:kms", "aws:kms:dsse")  # Their ETags are not the content's MD5.


def _crc32c():
  """google_crc32c's checksum function (an optional dependency, installed with gcsfs)."""
  try:
    import google_crc32c  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ImportError("a CRC-32C checksum needs the google-crc32c package "
                      "(pip install -e '.[gcs]')") from None
  return google_crc32c


def compute(path: str, kind: str) -> int | str:
  """The `kind` digest of the file or object at `path`, from its bytes (in pieces)."""
  chunks = storage.read_chunks(path, _OBJECT_CHUNK if storage.is_url(path) else _CHUNK)
  if kind == "crc32":
    crc = 0
    for chunk in chunks:
      crc = zlib.crc32(chunk, crc)
    return crc
  if kind == "crc32c":
    extend, crc = _crc32c().extend, 0
    for chunk in chunks:
      crc = extend(crc, chunk)
    return crc
  if kind == "md5":
    md5 = hashlib.md5()
    for chunk in chunks:
      md5.update(chunk)
    return md5.hexdigest()
  raise ValueError(f"unknown checksum kind {kind!r} (known: {', '.join(KINDS)})")


def _b64_int(value: str) -> int:
  return int.from_bytes(base64.b64decode(value), "big")


def _gcs(details: dict) -> dict | None:
  if details.get("md5Hash"):
    return {"md5": base64.b64decode(details["md5Hash"]).hex()}
  if details.get("crc32c"):  # A composite object has no md5Hash.
    return {"crc32c": _b64_int(details["crc32c"])}
  return None


def _s3(head: dict) -> dict | None:
  """The digest a HeadObject answer vouches for, or None."""
  full = head.get("ChecksumType", "FULL_OBJECT") == "FULL_OBJECT"
  for kind, key in (("crc32", "ChecksumCRC32"), ("crc32c", "ChecksumCRC32C")):
    value = head.get(key)
    if value and full and "-" not in value:
      return {kind: _b64_int(value)}
  etag = str(head.get("ETag", "")).strip('"')
  encrypted = head.get("ServerSideEncryption") in _KMS or head.get("SSECustomerAlgorithm")
  if _MD5_ETAG.fullmatch(etag) and not encrypted:
    return {"md5": etag}
  return None


def from_store(step_dir: str, found: dict[str, dict]) -> dict[str, dict]:
  """{rel: {"size": bytes, <kind>: digest, "tag": content tag}} for the objects `found`
  (`storage.listing(step_dir)`), from what the store computed when they were written."""
  rels = sorted(found)
  if storage.protocol(step_dir) == "s3":
    digests = [_s3(h) for h in storage.s3_heads([storage.join(step_dir, r) for r in rels])]
  elif storage.protocol(step_dir) in ("gs", "gcs"):
    digests = [_gcs(found[r]) for r in rels]
  else:
    digests = [None] * len(rels)
  out = {}
  for rel, digest in zip(rels, digests):
    if digest is None:  # The store vouches for nothing: the one read-back left.
      log.info("%s: no checksum from the store; reading it back", storage.join(step_dir, rel))
      digest = {"crc32": compute(storage.join(step_dir, rel), "crc32")}
    out[rel] = {"size": int(found[rel].get("size") or 0), **digest}
    if (tag := storage.content_tag(found[rel])) is not None:
      out[rel]["tag"] = tag
  return out


def kind_of(entry: dict) -> str:
  """The digest kind a record's entry holds (ValueError when it holds none)."""
  kind = next((k for k in KINDS if k in entry), None)
  if kind is None:
    raise ValueError(f"no checksum of a known kind ({', '.join(KINDS)}) in {entry}")
  return kind

"""Conditional writes of one object, each the store's own compare-and-swap: create if
absent, replace or delete only the version that was read (a LOCK's lease, a log's
segments: train/lifecycle/lock.py, train/io/runlog.py).

  S3       create `If-None-Match: *`; replace / delete `If-Match: <ETag>`
  GCS      create `ifGenerationMatch=0`; replace / delete `ifGenerationMatch=<generation>`
  local    create: the data written to a temporary file, hard-linked to the path (fails if
           it exists: never seen half written); replace / delete: under an exclusive
           flock of the parent directory, the file's bytes compared with the version read
           (the version is their SHA-256), then a rename over it / removal. flock is
           race-free between processes of one host (a local run directory's only users).
  memory   as local, under a process-wide lock.

Idempotent retries: a request whose answer is lost (a reset, a timeout) is retried, by
the storage layer or by the client library; if the first one landed, the retry is refused
(412) as if another writer held the object. Every write therefore carries a token of its
writer (S3 / GCS object metadata `blockwork-writer`), and a 412 is resolved by reading
the object back once: our token there means the write succeeded.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import threading
import uuid
from typing import NamedTuple
from urllib.parse import quote

from fsspec.asyn import sync

from train.io import storage

WRITER = "blockwork-writer"  # The metadata key of the writer's token.
# The storage layer's retries and filesystems (this module is its conditional half).
_remote, _fs = storage._remote, storage._fs  # pylint: disable=protected-access
_MEMORY_LOCK = threading.Lock()  # memory:// lives in this process: a lock makes it atomic.


class Versioned(NamedTuple):
  data: bytes
  version: str  # S3 ETag, GCS generation; locally (and memory://) the bytes' SHA-256.
  writer: str  # The token of the write that made it ("" where the store keeps none).


def new_token() -> str:
  return uuid.uuid4().hex


def _sha(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def _precondition(e: BaseException) -> bool:
  text = str(e)
  return isinstance(e, FileExistsError) or any(
      w in text.lower() for w in ("preconditionfailed", "pre-condition", "precondition"))


def _check(protocol: str, path: str) -> None:
  if protocol not in storage.ATOMIC_CREATE:
    raise storage.StorageError(
        "create", path, f"{protocol}:// has no atomic create-if-absent that this layer "
        f"knows (supported: {', '.join(sorted(storage.ATOMIC_CREATE))})")


def _attempt(operation: str, path: str, fn, token: str) -> str | None:
  """fn() (a conditional write returning the new version) with the storage layer's
  retries; on a refused precondition, the object read back once: ours -> its version."""
  def call():
    try:
      return fn()
    except Exception as e:  # pylint: disable=broad-except  (a 412, by any client's name)
      if _precondition(e):
        raise FileExistsError(errno.EEXIST, "precondition failed", path) from e
      raise
  try:
    return _remote(operation, path, call)
  except FileExistsError:
    now = read(path)
    return now.version if now is not None and now.writer == token else None


# ---- S3 -------------------------------------------------------------------------------


def _s3(path: str):
  fs = _fs(path)
  bucket, key, _ = fs.split_path(path)
  return fs, bucket, key


async def _s3_get(fs, bucket: str, key: str) -> Versioned:
  resp = await fs._call_s3("get_object", Bucket=bucket, Key=key)  # pylint: disable=protected-access
  body = resp["Body"]
  try:
    data = await body.read()
  finally:
    body.close()
  return Versioned(data, resp["ETag"], resp.get("Metadata", {}).get(WRITER, ""))


def _s3_put(path: str, data: bytes, token: str, **condition) -> str:
  fs, bucket, key = _s3(path)
  resp = fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data,
                    Metadata={WRITER: token}, **condition)
  fs.invalidate_cache(path)
  return resp["ETag"]


# ---- GCS ------------------------------------------------------------------------------


def _gcs_put(path: str, data: bytes, token: str, generation: str) -> str:
  """One multipart upload (object metadata with the token, then the bytes) on the
  condition `ifGenerationMatch=generation` ("0": absent)."""
  fs = _fs(path)
  bucket, key, _ = fs.split_path(path)
  meta = json.dumps({"name": key, "metadata": {WRITER: token}})
  body = (f"--==0==\nContent-Type: application/json; charset=UTF-8\n\n{meta}\n--==0==\n"
          "Content-Type: application/octet-stream\n\n").encode() + data + b"\n--==0==--"
  url = f"{fs._location}/upload/storage/v1/b/{quote(bucket)}/o"  # pylint: disable=protected-access
  out = fs.call("POST", url,
                uploadType="multipart", ifGenerationMatch=generation, json_out=True,
                headers={"Content-Type": 'multipart/related; boundary="==0=="'}, data=body)
  fs.invalidate_cache(path)
  return str(out["generation"])


def _gcs_get(path: str) -> Versioned:
  fs = _fs(path)
  bucket, key, _ = fs.split_path(path)
  fs.invalidate_cache(path)
  info = fs.info(path)
  generation = str(info["generation"])
  _, data = fs.call("GET", "b/{}/o/{}", bucket, key, alt="media", generation=generation)
  return Versioned(data, generation, (info.get("metadata") or {}).get(WRITER, ""))


# ---- local and memory:// --------------------------------------------------------------


@contextlib.contextmanager
def _guarded(path: str):
  """The exclusive right to replace or delete files of `path`'s directory."""
  if storage.is_url(path):
    with _MEMORY_LOCK:
      yield
    return
  fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)
    yield
  finally:
    os.close(fd)  # Releases the flock.


def _local_put(path: str, data: bytes, exclusive: bool) -> None:
  local = storage.local_path(path)
  if local is None:  # memory://
    fs = _fs(path)
    if exclusive and fs.exists(path):
      raise FileExistsError(errno.EEXIST, "exists", path)
    fs.pipe_file(path, data)
    return
  tmp = f"{local}.tmp.{os.getpid()}.{threading.get_ident()}"
  with open(tmp, "wb") as f:
    f.write(data)
  try:
    if exclusive:
      os.link(tmp, local)
    else:
      os.replace(tmp, local)
  finally:
    if os.path.lexists(tmp):
      os.remove(tmp)


# ---- the operations -------------------------------------------------------------------


def read(path: str) -> Versioned | None:
  """The object's bytes with their version and writer's token; None when absent."""
  proto = storage.protocol(path)
  try:
    if proto in ("s3", "s3a"):
      fs, bucket, key = _s3(path)
      return _remote("read", path, lambda: sync(
          fs.loop, _s3_get, fs, bucket, key), missing_ok=True)
    if proto in ("gs", "gcs"):
      return _remote("read", path, lambda: _gcs_get(path), missing_ok=True)
    data = storage.read_bytes(path)
  except FileNotFoundError:
    return None
  return Versioned(data, _sha(data), "")


def create(path: str, data: bytes) -> str | None:
  """Creates `path` holding `data` if nothing is there (atomically): its version, or
  None when it exists (and is not this call's own write, landed before a lost answer)."""
  proto, token = storage.protocol(path), new_token()
  if proto in ("s3", "s3a"):
    return _attempt("create", path, lambda: _s3_put(path, data, token, IfNoneMatch="*"),
                    token)
  if proto in ("gs", "gcs"):
    return _attempt("create", path, lambda: _gcs_put(path, data, token, "0"), token)
  if proto != "file":
    _check(proto, path)
  try:
    with _guarded(path) if proto == "memory" else contextlib.nullcontext():
      _local_put(path, data, exclusive=True)
  except FileExistsError:
    return None
  return _sha(data)


def create_exclusive(path: str, data: bytes) -> bool:
  """Creates `path` holding `data` if nothing is there (atomically); False if it exists."""
  return create(path, data) is not None


def replace_if(path: str, data: bytes, version: str) -> str | None:
  """`data` over the object if it is still at `version`: the new version, else None."""
  proto, token = storage.protocol(path), new_token()
  if proto in ("s3", "s3a"):
    return _attempt("replace", path, lambda: _s3_put(path, data, token, IfMatch=version),
                    token)
  if proto in ("gs", "gcs"):
    return _attempt("replace", path, lambda: _gcs_put(path, data, token, version), token)
  with _guarded(path):
    now = read(path)
    if now is None or now.version != version:
      return None
    _local_put(path, data, exclusive=False)
  return _sha(data)


def delete_if(path: str, version: str) -> bool:
  """Removes the object if it is still at `version`; False (kept) otherwise."""
  proto = storage.protocol(path)
  if proto in ("s3", "s3a", "gs", "gcs"):
    fs = _fs(path)
    bucket, key, _ = fs.split_path(path)

    def rm():
      if proto.startswith("s3"):
        fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=version)
      else:
        fs.call("DELETE", "b/{}/o/{}", bucket, key, ifGenerationMatch=version)
      fs.invalidate_cache(path)
    try:
      _remote("delete", path, rm, missing_ok=True)
    except FileNotFoundError:  # Gone already (a retried delete whose first one landed).
      return True
    except FileExistsError:  # gcsfs's name for a 412: another version is there now.
      return False
    except storage.StorageError as e:
      if _precondition(e.__cause__ or e):
        return False
      raise
    return True
  with _guarded(path):
    now = read(path)
    if now is None or now.version != version:
      return False
    storage.delete(path)
  return True

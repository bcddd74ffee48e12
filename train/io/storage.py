"""One layer for every path of a run directory: a local path or any fsspec URL
(gs://, s3://, memory://...). The run lifecycle, metrics and the report call it, never
os.path on a run.

Local paths keep POSIX semantics (atomic write: a temporary file renamed over the
target; exclusive create: O_EXCL). On a bucket a write is one PUT of the whole object
(an object appears whole or not at all). Conditional writes (create if absent, replace
or delete one version: the store's own preconditions, each carrying its writer's token)
are train/io/conditional.py.

Credentials are the environment's (ADC for GCS, the AWS chain for S3; an emulator by
its documented endpoint variable, AWS_ENDPOINT_URL / STORAGE_EMULATOR_HOST): nothing
here reads, writes or logs them. A failed request is retried a bounded number of times
with backoff when it may pass (throttled, connection reset), then raised as
`StorageError`, which names the operation and the URL.

`REQUESTS` counts the operations sent to object storage (by kind), so that a writer's
cost per training step can be measured (docs/PERFORMANCE.md, "Object storage").
"""

from __future__ import annotations

import asyncio
import collections
import errno
import glob as globlib
import logging
import os
import posixpath
import time
from typing import Any, Callable, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

# Protocols whose store creates an object only if absent, atomically.
ATOMIC_CREATE = frozenset({"s3", "s3a", "gs", "gcs", "memory"})
RETRIES = 4  # Attempts of one operation before StorageError.
BACKOFF_S = 0.5  # The first wait; doubled after each failed attempt.
REQUESTS: collections.Counter = collections.Counter()  # operation -> requests sent.
_HEADS_AT_ONCE = 256  # HeadObject requests in flight at once (s3_heads).


class StorageError(OSError):
  """An object-storage operation that failed: names the operation, the URL and why."""

  def __init__(self, operation: str, url: str, reason: str):
    super().__init__(f"{operation} {url}: {reason}")
    self.operation, self.url, self.reason = operation, url, reason


def is_url(path: str) -> bool:
  """True for an fsspec URL other than file:// (a bucket, memory://...)."""
  return "://" in str(path) and not str(path).startswith("file://")


def protocol(path: str) -> str:
  return str(path).split("://", 1)[0] if is_url(path) else "file"


def _local(path: str) -> str:
  path = str(path)
  return path[len("file://"):] if path.startswith("file://") else path


def local_path(path: str) -> str | None:
  """The filesystem path for a library that needs one (None for a URL)."""
  return None if is_url(path) else _local(path)


def absolute(path: str) -> str:
  """A URL as it is; a local path made absolute (for records naming another run)."""
  return str(path) if is_url(path) else os.path.abspath(_local(path))


def join(base: str, *parts: str) -> str:
  if is_url(base):
    return posixpath.join(str(base).rstrip("/"), *parts)
  return os.path.join(_local(base), *parts)


def parent(path: str) -> str:
  return posixpath.dirname(str(path).rstrip("/")) if is_url(path) else os.path.dirname(path)


# The options etils.epath (orbax's writer of metadata and commit markers) opens gcsfs
# with: fsspec keeps one instance per options, so this layer and orbax share one, and
# one listing cache (with another, orbax's cache misses what this layer deleted).
_OPTIONS = {"gs": {"finalize_on_close": True}, "gcs": {"finalize_on_close": True}}


def _fs(path: str):
  import fsspec  # pylint: disable=g-import-not-at-top
  try:
    fs, _ = fsspec.core.url_to_fs(str(path), **_OPTIONS.get(protocol(path), {}))
  except ImportError as e:  # gcsfs / s3fs not installed.
    raise StorageError("open", str(path), f"{e} (pip install -e '.[gcs]' for gs://, "
                       "'.[s3]' for s3://)") from None
  return fs


def _transient(e: BaseException) -> bool:
  if isinstance(e, (FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError)):
    return False
  if isinstance(e, (ConnectionError, TimeoutError)):
    return True
  text = str(e).lower()
  return (getattr(e, "errno", None) in (errno.EBUSY, errno.EAGAIN, errno.ETIMEDOUT)
          or any(w in text for w in ("slowdown", "throttl", "too many requests", "429", "503",
                                     "rate exceeded", "reduce your request rate")))


def _reason(e: BaseException, operation: str) -> str:
  if isinstance(e, PermissionError):
    return (f"permission denied ({e}); credentials come from the environment (ADC for "
            "gs://, the AWS chain for s3://)")
  if isinstance(e, FileNotFoundError):
    what = "no such bucket" if operation in ("write", "create", "list", "makedirs") else (
        "no such object or bucket")
    return f"{what} ({e})"
  if _transient(e):
    return f"throttled or unavailable after {RETRIES} attempts ({type(e).__name__}: {e})"
  return f"{type(e).__name__}: {e}"


def _remote(operation: str, url: str, fn: Callable[[], T], missing_ok: bool = False) -> T:
  """fn() with bounded retries; FileNotFoundError passes through when `missing_ok`."""
  for attempt in range(RETRIES):
    REQUESTS[operation] += 1
    try:
      return fn()
    except FileExistsError:
      raise
    except FileNotFoundError:
      if missing_ok:
        raise
      raise StorageError(operation, url, _reason(FileNotFoundError(url), operation)) from None
    except Exception as e:  # pylint: disable=broad-except  (classified, then re-raised)
      if not _transient(e) or attempt == RETRIES - 1:
        raise StorageError(operation, url, _reason(e, operation)) from e
      wait = BACKOFF_S * 2**attempt
      log.warning("%s %s: %s; retrying in %.1f s", operation, url, type(e).__name__, wait)
      time.sleep(wait)
  raise AssertionError("unreachable")


def request_count() -> int:
  return sum(REQUESTS.values())


def exists(path: str) -> bool:
  """An object, a file, or a directory / prefix holding objects."""
  if not is_url(path):
    return os.path.exists(_local(path))
  fs = _fs(path)
  fs.invalidate_cache(str(path))
  return _remote("exists", path, lambda: fs.exists(str(path)))


def read_bytes(path: str) -> bytes:
  """The whole file; FileNotFoundError (naming `path`) when it does not exist."""
  if not is_url(path):
    with open(_local(path), "rb") as f:
      return f.read()
  fs = _fs(path)
  try:
    return _remote("read", path, lambda: fs.cat_file(str(path)), missing_ok=True)
  except FileNotFoundError:
    raise FileNotFoundError(errno.ENOENT, "no such object", str(path)) from None


def read_many(paths: list[str]) -> list[bytes]:
  """The files' bytes, in order; on a bucket fetched concurrently (a log's segments)."""
  if not paths or not is_url(paths[0]):
    return [read_bytes(p) for p in paths]
  fs = _fs(paths[0])
  REQUESTS["read"] += len(paths) - 1  # _remote counts one.
  try:
    got = _remote("read", paths[0], lambda: fs.cat([str(p) for p in paths], on_error="raise"),
                  missing_ok=True)
  except FileNotFoundError:
    missing = [p for p in paths if not exists(p)] or paths  # Which one, for the message.
    raise FileNotFoundError(errno.ENOENT, "no such object", str(missing[0])) from None
  by_key = {k.lstrip("/"): v for k, v in got.items()}
  return [by_key[str(p).split("://", 1)[1].lstrip("/")] for p in paths]


def read_text(path: str) -> str:
  return read_bytes(path).decode("utf-8")


def write_bytes(path: str, data: bytes) -> None:
  """The whole file at once: a reader sees the old content or the new, never a part."""
  if not is_url(path):
    path = _local(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
      f.write(data)
    os.replace(tmp, path)
    return
  fs = _fs(path)
  _remote("write", path, lambda: fs.pipe_file(str(path), data))


def write_text(path: str, text: str) -> None:
  write_bytes(path, text.encode("utf-8"))


def append_text(path: str, text: str) -> None:
  """Local files only (O_APPEND): objects are never appended to (see train/io/runlog.py)."""
  if is_url(path):
    raise StorageError("append", path, "objects cannot be appended to; write a new object")
  with open(_local(path), "a", encoding="utf-8") as f:
    f.write(text)


def listdir(path: str) -> list[str]:
  """The names directly under `path`, sorted ([] when it does not exist)."""
  if not is_url(path):
    path = _local(path)
    return sorted(os.listdir(path)) if os.path.isdir(path) else []
  fs = _fs(path)
  fs.invalidate_cache(str(path))
  try:
    entries = _remote("list", path, lambda: fs.ls(str(path), detail=False), missing_ok=True)
  except FileNotFoundError:
    return []
  base = str(path).split("://", 1)[1].strip("/")
  names = {posixpath.basename(e.rstrip("/")) for e in entries if e.strip("/") != base}
  return sorted(names)


def isdir(path: str) -> bool:
  if not is_url(path):
    return os.path.isdir(_local(path))
  return bool(listdir(path))


def s3_heads(paths: list[str]) -> list[dict]:
  """HeadObject of each s3:// object (ChecksumMode=ENABLED: its ETag, encryption and the
  full-object checksum its writer sent, ChecksumCRC32 / ChecksumCRC32C..., if any), in
  order: a request each, sent concurrently by one client; no bytes read."""
  if not paths:
    return []
  from fsspec.asyn import sync  # pylint: disable=g-import-not-at-top
  fs = _fs(paths[0])

  async def heads(batch):
    return await asyncio.gather(*(fs._call_s3(  # pylint: disable=protected-access
        "head_object", Bucket=b, Key=k, ChecksumMode="ENABLED")
        for b, k, _ in map(fs.split_path, map(str, batch))))

  out = []
  for start in range(0, len(paths), _HEADS_AT_ONCE):
    batch = paths[start:start + _HEADS_AT_ONCE]
    REQUESTS["head"] += len(batch) - 1  # _remote counts one.
    out += _remote("head", batch[0], lambda b=batch: sync(fs.loop, heads, b))
  return out


def listing(path: str) -> dict[str, dict]:
  """{path relative to `path`: the store's details (fsspec's: size, ETag / md5Hash,
  crc32c...)} of every object under `path` ({} when there is none; a URL only). One
  listing request."""
  fs = _fs(path)
  fs.invalidate_cache(str(path))
  base = str(path).split("://", 1)[1].strip("/") + "/"
  try:
    found = _remote("list", path, lambda: fs.find(str(path), detail=True), missing_ok=True)
  except FileNotFoundError:
    return {}
  return {k.lstrip("/")[len(base):]: v for k, v in found.items()
          if k.lstrip("/").startswith(base) and v.get("type") != "directory"}


def files(path: str) -> dict[str, int]:
  """{path relative to `path`: size in bytes} of every file or object under `path`, at any
  depth ({} when there is none). One listing request on a bucket."""
  if is_url(path):
    return {rel: int(v.get("size") or 0) for rel, v in listing(path).items()}
  root = _local(path)
  return {os.path.relpath(os.path.join(here, n), root): os.path.getsize(os.path.join(here, n))
          for here, _, names in os.walk(root) for n in names}


def content_tags(path: str) -> dict[str, str]:
  """{path relative to `path`: the store's tag of its content (S3's ETag, GCS's md5Hash)},
  from one listing: it changes whenever the object is rewritten. {} for a local path."""
  tags = {rel: content_tag(v) for rel, v in (listing(path) if is_url(path) else {}).items()}
  return {rel: tag for rel, tag in tags.items() if tag}


def content_tag(details: dict) -> str | None:
  """The content tag in one object's listing details (`listing`), or None."""
  tag = (details.get("ETag") or details.get("etag") or details.get("md5Hash")
         or details.get("crc32c"))
  return str(tag) if tag else None


def read_chunks(path: str, chunk_bytes: int = 1 << 22):
  """The file's bytes in pieces of at most `chunk_bytes` (a large object is never held
  whole); on a bucket, one ranged read per piece."""
  if not is_url(path):
    with open(_local(path), "rb") as f:
      yield from iter(lambda: f.read(chunk_bytes), b"")
    return
  fs = _fs(path)
  size = _remote("read", path, lambda: fs.size(str(path)))
  for start in range(0, size, chunk_bytes):
    end = min(start + chunk_bytes, size)
    yield _remote("read", path, lambda s=start, e=end: fs.cat_file(str(path), start=s, end=e))


def copy(src: str, dst: str) -> None:
  """One file or object to `dst` in the same store (a server-side copy on a bucket)."""
  if not is_url(src) and not is_url(dst):
    import shutil  # pylint: disable=g-import-not-at-top
    os.makedirs(os.path.dirname(_local(dst)) or ".", exist_ok=True)
    shutil.copyfile(_local(src), _local(dst))
    return
  fs = _fs(src)
  _remote("copy", src, lambda: fs.copy(str(src), str(dst)))


def copy_tree(src: str, dst: str, key: Callable[[str], Any] | None = None) -> list[str]:
  """Every file under `src` to the same place under `dst`, byte for byte (a server-side
  copy within one store, else read and written), in the order of `key` (the relative
  path's sort key: markers a reader trusts go last), else sorted; the paths copied."""
  rels = sorted(files(src), key=key)
  for rel in rels:
    here, there = join(src, *rel.split(os.sep)), join(dst, *rel.split(os.sep))
    if protocol(src) == protocol(dst):
      copy(here, there)
    else:
      write_bytes(there, read_bytes(here))
  return rels


def glob(pattern: str) -> list[str]:
  """Paths matching `pattern` (`*`, `?`, `[...]`), sorted; URLs keep their protocol."""
  if not is_url(pattern):
    return sorted(globlib.glob(_local(pattern)))
  fs, proto = _fs(pattern), protocol(pattern)
  fs.invalidate_cache()
  found = _remote("list", pattern, lambda: fs.glob(str(pattern)))
  return sorted(p if "://" in p else f"{proto}://{p.lstrip('/')}" for p in found)


def walk(root: str):
  """(directory, subdirectories, files) under `root`, top-down, as os.walk (prune the
  subdirectories in place); on a bucket the directories are the prefixes."""
  if not is_url(root):
    yield from os.walk(_local(root))
    return
  fs, proto = _fs(root), protocol(root)
  fs.invalidate_cache()
  REQUESTS["list"] += 1
  try:
    for here, dirs, files in fs.walk(str(root)):
      yield (here if "://" in here else f"{proto}://{here.lstrip('/')}"), dirs, files
  except FileNotFoundError:
    return
  except Exception as e:  # pylint: disable=broad-except
    raise StorageError("list", root, _reason(e, "list")) from e


def relpath(path: str, root: str) -> str:
  """`path` relative to `root` ("." for root itself), with "/" on a bucket."""
  if not is_url(path):
    return os.path.relpath(_local(path), _local(root))
  return posixpath.relpath("/" + path.split("://", 1)[1].strip("/"),
                           "/" + root.split("://", 1)[1].strip("/"))


def delete(path: str, recursive: bool = False) -> None:
  """Removes a file or object (with `recursive`, a directory / prefix); absent is fine."""
  if not is_url(path):
    path = _local(path)
    if recursive and os.path.isdir(path):
      import shutil  # pylint: disable=g-import-not-at-top
      shutil.rmtree(path)
    elif os.path.lexists(path):
      os.remove(path)
    return
  fs = _fs(path)
  try:
    _remote("delete", path, lambda: fs.rm(str(path), recursive=recursive), missing_ok=True)
  except FileNotFoundError:
    pass


def makedirs(path: str) -> None:
  """A local directory (and its parents); a no-op on a bucket, which has no directories."""
  if not is_url(path):
    os.makedirs(_local(path), exist_ok=True)

"""The objects of tests/gcs_server.py's local GCS: buckets of objects in memory, each
with its generation and metageneration as GCS keeps them, and GCS's preconditions.

- A write (any upload, a copy) makes a new generation, larger than every generation
  given before (as on GCS, numbers from a microsecond clock); metageneration 1.
  A metadata update (PATCH) keeps the generation and adds one to the metageneration.
- Preconditions as GCS's JSON API: `ifGenerationMatch` (0: the object must be absent),
  `ifGenerationNotMatch`, `ifMetagenerationMatch`, `ifMetagenerationNotMatch`; a failed
  one raises `Failed(412)` (a read whose `ifGenerationNotMatch` / `ifMetagenerationNotMatch`
  fails: `Failed(304)`, Not Modified).
- Only the live generation is kept (no versioned bucket): a read of another
  `generation` is 404.
- Listing in name order with `prefix`, `delimiter` (prefixes), `startOffset` /
  `endOffset`, `matchGlob` (`*`, `**`, `?`), pages of `maxResults` with `pageToken`.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import hashlib
import re
import threading
import time

import google_crc32c


class Failed(Exception):
  """A request the store refuses: `status` is the HTTP answer (404, 409, 412, 304...)."""

  def __init__(self, status: int, message: str):
    super().__init__(message)
    self.status, self.message = status, message


@dataclasses.dataclass
class Obj:
  bucket: str
  name: str
  data: bytes
  generation: int
  metageneration: int = 1
  content_type: str = "application/octet-stream"
  metadata: dict = dataclasses.field(default_factory=dict)
  created: float = dataclasses.field(default_factory=time.time)
  updated: float = dataclasses.field(default_factory=time.time)

  def resource(self) -> dict:
    """The object's JSON resource as GCS answers it."""
    crc = google_crc32c.value(self.data).to_bytes(4, "big")
    return {
        "kind": "storage#object", "id": f"{self.bucket}/{self.name}/{self.generation}",
        "name": self.name, "bucket": self.bucket, "generation": str(self.generation),
        "metageneration": str(self.metageneration), "contentType": self.content_type,
        "size": str(len(self.data)), "storageClass": "STANDARD",
        "md5Hash": base64.b64encode(hashlib.md5(self.data).digest()).decode(),
        "crc32c": base64.b64encode(crc).decode(),
        "etag": base64.b64encode(f"{self.generation}/{self.metageneration}".encode()).decode(),
        "timeCreated": _rfc3339(self.created), "updated": _rfc3339(self.updated),
        **({"metadata": dict(self.metadata)} if self.metadata else {}),
    }


def _rfc3339(t: float) -> str:
  return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime(
      "%Y-%m-%dT%H:%M:%S.%fZ")


def _int(query: dict, key: str) -> int | None:
  value = query.get(key)
  if value in (None, ""):
    return None
  try:
    return int(value)
  except ValueError:
    raise Failed(400, f"{key}={value!r} is not an integer") from None


def check(obj: Obj | None, query: dict, read: bool = False) -> None:
  """Raises Failed when one of the request's preconditions does not hold for `obj`."""
  generation = obj.generation if obj else 0
  match, not_match = _int(query, "ifGenerationMatch"), _int(query, "ifGenerationNotMatch")
  meta, not_meta = _int(query, "ifMetagenerationMatch"), _int(query, "ifMetagenerationNotMatch")
  if match is not None and match != generation:
    raise Failed(412, f"ifGenerationMatch={match}: the object is at generation {generation}")
  if meta is not None and (obj is None or meta != obj.metageneration):
    raise Failed(412, f"ifMetagenerationMatch={meta} does not hold")
  status = 304 if read else 412
  if not_match is not None and not_match == generation:
    raise Failed(status, f"ifGenerationNotMatch={not_match}: the object is at it")
  if not_meta is not None and obj is not None and not_meta == obj.metageneration:
    raise Failed(status, f"ifMetagenerationNotMatch={not_meta}: the object is at it")


def _glob(pattern: str, name: str) -> bool:
  """GCS's matchGlob: `**` any characters, `*` and `?` within one path segment."""
  regex = "".join(".*" if part == "**" else "[^/]*" if part == "*" else "[^/]"
                  if part == "?" else re.escape(part)
                  for part in re.split(r"(\*\*|\*|\?)", pattern))
  return re.fullmatch(regex, name) is not None


class Store:
  """Buckets of objects; every method is atomic (one lock)."""

  def __init__(self):
    self._lock = threading.Lock()
    self._buckets: dict[str, dict[str, Obj]] = {}
    self._last_generation = 0

  def _generation(self) -> int:
    self._last_generation = max(self._last_generation + 1, time.time_ns() // 1000)
    return self._last_generation

  def _bucket(self, bucket: str) -> dict[str, Obj]:
    if bucket not in self._buckets:
      raise Failed(404, f"The specified bucket does not exist: {bucket}")
    return self._buckets[bucket]

  def create_bucket(self, bucket: str) -> None:
    with self._lock:
      if bucket in self._buckets:
        raise Failed(409, f"The bucket {bucket} already exists")
      self._buckets[bucket] = {}

  def has_bucket(self, bucket: str) -> bool:
    with self._lock:
      return bucket in self._buckets

  def buckets(self) -> list[str]:
    with self._lock:
      return sorted(self._buckets)

  def delete_bucket(self, bucket: str) -> None:
    with self._lock:
      if self._bucket(bucket):
        raise Failed(409, f"The bucket {bucket} is not empty")
      del self._buckets[bucket]

  def get(self, bucket: str, name: str, query: dict, read: bool = True) -> Obj:
    with self._lock:
      obj = self._bucket(bucket).get(name)
      want = _int(query, "generation")
      if obj is None or (want is not None and want != obj.generation):
        check(None, query, read)
        raise Failed(404, f"No such object: {bucket}/{name}")
      check(obj, query, read)
      return dataclasses.replace(obj)

  def put(self, bucket: str, name: str, data: bytes, query: dict, content_type: str = "",
          metadata: dict | None = None) -> Obj:
    """A new generation of `name` holding `data`, if the preconditions hold."""
    with self._lock:
      objects = self._bucket(bucket)
      check(objects.get(name), query)
      obj = Obj(bucket, name, bytes(data), self._generation(),
                content_type=content_type or "application/octet-stream",
                metadata=dict(metadata or {}))
      objects[name] = obj
      return dataclasses.replace(obj)

  def patch(self, bucket: str, name: str, query: dict, changes: dict) -> Obj:
    """Metadata (`metadata`, `contentType`) changed in place: metageneration + 1."""
    with self._lock:
      obj = self._bucket(bucket).get(name)
      if obj is None:
        raise Failed(404, f"No such object: {bucket}/{name}")
      check(obj, query)
      for key, value in (changes.get("metadata") or {}).items():
        if value is None:
          obj.metadata.pop(key, None)
        else:
          obj.metadata[key] = str(value)
      obj.content_type = changes.get("contentType") or obj.content_type
      obj.metageneration += 1
      obj.updated = time.time()
      return dataclasses.replace(obj)

  def delete(self, bucket: str, name: str, query: dict) -> None:
    with self._lock:
      objects = self._bucket(bucket)
      obj = objects.get(name)
      want = _int(query, "generation")
      if obj is None or (want is not None and want != obj.generation):
        raise Failed(404, f"No such object: {bucket}/{name}")
      check(obj, query)
      del objects[name]

  def list(self, bucket: str, query: dict) -> dict:
    """One page of the listing, as GCS answers it: {items, prefixes, nextPageToken}."""
    prefix, delimiter = query.get("prefix") or "", query.get("delimiter") or ""
    start, end = query.get("startOffset") or "", query.get("endOffset") or ""
    glob = query.get("matchGlob") or ""
    after = base64.urlsafe_b64decode(query.get("pageToken") or "").decode()  # Opaque, as GCS's.
    limit = _int(query, "maxResults") or 1000
    trailing = query.get("includeTrailingDelimiter") == "true"
    with self._lock:
      names = sorted(self._bucket(bucket))
      objects = dict(self._bucket(bucket))
    items, prefixes, token = [], [], None
    for name in names:
      if (not name.startswith(prefix) or name < start or (end and name >= end)
          or (after and name <= after) or (glob and not _glob(glob, name))):
        continue
      if len(items) + len(prefixes) >= limit:
        token = last
        break
      cut = name.find(delimiter, len(prefix)) if delimiter else -1
      if cut >= 0:
        sub = name[:cut + len(delimiter)]
        if sub not in prefixes:
          prefixes.append(sub)
        if trailing and name == sub:
          items.append(objects[name].resource())
        last = sub + "\U0010ffff"  # The next page starts after everything under it.
      else:
        items.append(objects[name].resource())
        last = name
    out = {"kind": "storage#objects", "items": items}
    if prefixes:
      out["prefixes"] = prefixes
    if token:
      out["nextPageToken"] = base64.urlsafe_b64encode(token.encode()).decode()
    return out

"""A local GCS server for the tests: the part of GCS's JSON API that gcsfs (the storage
layer, etils.epath) and TensorStore's `gcs` driver (orbax's array writer) use, over
tests/gcs_store.py's objects with their generations. It answers in a thread of the test
process; clients find it by STORAGE_EMULATOR_HOST (gcsfs) and TENSORSTORE_GCS_HTTP_URL
(TensorStore), with any bearer token (GOOGLE_AUTH_TOKEN_FOR_TESTING): none is checked.

Implemented (paths under /storage/v1, /upload/storage/v1, /download/storage/v1):
  buckets     insert, get, list, delete
  objects     insert (uploadType=media, multipart, resumable: a session URL, PUT of the
              bytes in one or several chunks with Content-Range, 308 until complete),
              get (the JSON resource; alt=media: the bytes, with a Range header 206 and
              Content-Range; 416 past the end), list (prefix, delimiter, startOffset,
              endOffset, matchGlob, maxResults + pageToken), patch (metadata), delete,
              rewriteTo / copyTo (one call, done)
  every object answer carries x-goog-generation and x-goog-metageneration (media also
  x-goog-hash crc32c and md5, x-goog-stored-content-length); the resource has
  generation, metageneration, size, md5Hash, crc32c, etag, metadata
  preconditions   ifGenerationMatch (0: create only), ifGenerationNotMatch,
              ifMetagenerationMatch, ifMetagenerationNotMatch: 412 (a read: 304 for
              the NotMatch ones), with a JSON error body as GCS's
Not implemented: object versioning (only the live generation), compose, the batch
endpoint (gcsfs uses it only on Google's own host), ACLs / IAM, authentication, XML API,
gRPC, retention, notifications; `fields` and `projection` are ignored (the whole
resource is returned).
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import itertools
import json
import threading
from urllib.parse import parse_qs, unquote, urlsplit

import google_crc32c

from tests.gcs_store import Failed, Obj, Store


def _split(path: str) -> list[str]:
  """The path's segments, each unquoted (an object name's "/" arrives as %2F)."""
  return [unquote(p) for p in path.strip("/").split("/")]


def _multipart(body: bytes, content_type: str) -> tuple[dict, bytes, str]:
  """(metadata, media, media content type) of a multipart/related upload."""
  boundary = content_type.split("boundary=", 1)[1].split(";")[0].strip().strip('"')
  parts = body.split(b"--" + boundary.encode())[1:3]
  if len(parts) != 2:
    raise Failed(400, "a multipart upload needs a metadata part and a media part")
  out = []
  for part in parts:
    newline = b"\r\n" if part.startswith(b"\r\n") else b"\n"
    part = part[len(newline):]
    head, _, data = part.partition(newline * 2)
    if data.endswith(newline):
      data = data[:-len(newline)]
    ctype = [line.split(b":", 1)[1].strip().decode() for line in head.split(newline)
             if line.lower().startswith(b"content-type:")]
    out.append((data, ctype[0] if ctype else ""))
  return json.loads(out[0][0] or b"{}"), out[1][0], out[1][1]


class Handler(http.server.BaseHTTPRequestHandler):
  """One request: routed by method and path to the store (`server.store`)."""

  protocol_version = "HTTP/1.1"
  disable_nagle_algorithm = True  # Headers and body are two writes: no 40 ms ACK wait.

  def log_message(self, format, *args):  # pylint: disable=redefined-builtin
    del format, args  # Quiet: a line per request otherwise.

  # ---- plumbing -----------------------------------------------------------------------

  def body(self) -> bytes:
    if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
      data = b""
      while True:
        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
        if size == 0:
          self.rfile.readline()
          return data
        data += self.rfile.read(size)
        self.rfile.readline()
    return self.rfile.read(int(self.headers.get("Content-Length") or 0))

  def reply(self, status: int, body: bytes = b"", headers: dict | None = None,
            content_type: str = "application/json; charset=UTF-8") -> None:
    self.send_response(status)
    for key, value in (headers or {}).items():
      self.send_header(key, value)
    if status not in (204, 304):
      self.send_header("Content-Type", content_type)
    self.send_header("Content-Length", str(len(body)))
    self.end_headers()
    if self.command != "HEAD" and status not in (204, 304):
      self.wfile.write(body)

  def reply_json(self, value: dict, status: int = 200, headers: dict | None = None) -> None:
    self.reply(status, json.dumps(value).encode(), headers)

  def reply_object(self, obj: Obj, status: int = 200) -> None:
    self.reply_json(obj.resource(), status, _generation_headers(obj))

  def reply_error(self, status: int, message: str) -> None:
    if status == 304:
      self.reply(304)
      return
    reason = {404: "notFound", 409: "conflict", 412: "conditionNotMet",
              416: "requestedRangeNotSatisfiable"}.get(status, "invalid")
    if status == 412:
      message = f"Precondition Failed: {message}"
    self.reply_json({"error": {"code": status, "message": message,
                          "errors": [{"message": message, "reason": reason}]}}, status)

  def _dispatch(self) -> None:
    url = urlsplit(self.path)
    query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
    segments = _split(url.path)
    try:
      self.server.route(self, self.command, segments, query)
    except Failed as e:
      self.reply_error(e.status, e.message)
    except Exception as e:  # pylint: disable=broad-except  (a 500 that names it)
      self.reply_error(500, f"{type(e).__name__}: {e}")

  do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _dispatch

  # ---- objects --------------------------------------------------------------------------

  def media(self, obj: Obj) -> None:
    size, headers = len(obj.data), _generation_headers(obj)
    headers["x-goog-stored-content-length"] = str(size)
    spec = self.headers.get("Range", "")
    if not spec.startswith("bytes="):
      crc = base64.b64encode(google_crc32c.value(obj.data).to_bytes(4, "big")).decode()
      md5 = base64.b64encode(hashlib.md5(obj.data).digest()).decode()
      headers["x-goog-hash"] = f"crc32c={crc},md5={md5}"
      self.reply(200, obj.data, headers, obj.content_type)
      return
    first, _, last = spec[len("bytes="):].split(",")[0].partition("-")
    if not first:  # bytes=-N: the last N.
      start, end = max(0, size - int(last)), size - 1
    else:
      start, end = int(first), min(int(last) if last else size - 1, size - 1)
    if start >= size or start > end:
      if size == 0 and start == 0:
        self.reply(200, b"", headers, obj.content_type)
        return
      raise Failed(416, f"Requested range not satisfiable: {spec} of {size} bytes")
    headers["Content-Range"] = f"bytes {start}-{end}/{size}"
    self.reply(206, obj.data[start:end + 1], headers, obj.content_type)


def _generation_headers(obj: Obj) -> dict:
  return {"x-goog-generation": str(obj.generation),
          "x-goog-metageneration": str(obj.metageneration),
          "ETag": f'"{obj.resource()["etag"]}"'}


class GcsServer(http.server.ThreadingHTTPServer):
  """The server: `url` once started; `store` holds the buckets."""

  daemon_threads = True

  def __init__(self, host: str = "127.0.0.1", port: int = 0):
    super().__init__((host, port), Handler)
    self.store = Store()
    self.url = f"http://{host}:{self.server_address[1]}"
    self._uploads: dict[str, dict] = {}
    self._ids = itertools.count(1)
    self._thread: threading.Thread | None = None

  def start(self) -> "GcsServer":
    self._thread = threading.Thread(target=self.serve_forever, daemon=True)
    self._thread.start()
    return self

  def stop(self) -> None:
    self.shutdown()
    self.server_close()

  def route(self, h: Handler, method: str, seg: list[str], query: dict) -> None:
    api = seg[:3]
    if api[1:3] != ["storage", "v1"] and seg[:2] != ["storage", "v1"]:
      raise Failed(404, f"no such API: /{'/'.join(seg)}")
    kind = seg[0] if seg[0] in ("upload", "download") else ""
    rest = seg[3:] if kind else seg[2:]
    if kind == "upload":
      self._upload(h, method, rest, query)
    elif not rest or rest[0] != "b":
      raise Failed(404, f"no such resource: /{'/'.join(seg)}")
    elif len(rest) <= 2:
      self._buckets(h, method, rest[1:], query)
    elif len(rest) == 3 and rest[2] == "o" and method == "GET":
      h.reply_json(self.store.list(rest[1], query))
    elif len(rest) == 4 and rest[2] == "o":
      self._one(h, method, rest[1], rest[3], query, media=kind == "download")
    elif len(rest) == 9 and rest[4] in ("rewriteTo", "copyTo") and method == "POST":
      self._copy(h, rest, query)
    else:
      raise Failed(404, f"no such resource: /{'/'.join(seg)}")

  def _buckets(self, h: Handler, method: str, name: list[str], query: dict) -> None:
    del query
    if not name and method == "POST":
      bucket = json.loads(h.body() or b"{}").get("name", "")
      self.store.create_bucket(bucket)
      h.reply_json({"kind": "storage#bucket", "name": bucket, "id": bucket})
    elif not name and method == "GET":
      h.reply_json({"kind": "storage#buckets", "items": [
          {"kind": "storage#bucket", "name": b, "id": b} for b in self.store.buckets()]})
    elif name and method == "GET":
      if not self.store.has_bucket(name[0]):
        raise Failed(404, f"The specified bucket does not exist: {name[0]}")
      h.reply_json({"kind": "storage#bucket", "name": name[0], "id": name[0],
               "location": "US", "storageClass": "STANDARD", "metageneration": "1"})
    elif name and method == "DELETE":
      self.store.delete_bucket(name[0])
      h.reply(204)
    else:
      raise Failed(405, f"{method} on buckets")

  def _one(self, h: Handler, method: str, bucket: str, name: str, query: dict,
           media: bool) -> None:
  
    if method in ("GET", "HEAD"):
      obj = self.store.get(bucket, name, query)
      if media or query.get("alt") == "media":
        h.media(obj)
      else:
        h.reply_object(obj)
    elif method == "PATCH":
      h.reply_object(self.store.patch(bucket, name, query, json.loads(h.body() or b"{}")))
    elif method == "DELETE":
      self.store.delete(bucket, name, query)
      h.reply(204)
    else:
      raise Failed(405, f"{method} on an object")

  def _copy(self, h: Handler, rest: list[str], query: dict) -> None:
    source = {"generation": query.get("sourceGeneration"),
              "ifGenerationMatch": query.get("ifSourceGenerationMatch"),
              "ifMetagenerationMatch": query.get("ifSourceMetagenerationMatch")}
    src = self.store.get(rest[1], rest[3], {k: v for k, v in source.items() if v}, read=False)
    body = json.loads(h.body() or b"{}")
    obj = self.store.put(rest[6], rest[8], src.data, query,
                         body.get("contentType") or src.content_type,
                         body.get("metadata") or src.metadata)
    if rest[4] == "copyTo":
      h.reply_object(obj)
      return
    size = str(len(obj.data))
    h.reply_json({"kind": "storage#rewriteResponse", "done": True, "objectSize": size,
             "totalBytesRewritten": size, "resource": obj.resource()})

  # ---- uploads --------------------------------------------------------------------------

  def _upload(self, h: Handler, method: str, rest: list[str], query: dict) -> None:
  
    if len(rest) != 3 or rest[0] != "b" or rest[2] != "o":
      raise Failed(404, f"no such upload resource: {'/'.join(rest)}")
    bucket, kind = rest[1], query.get("uploadType", "media")
    if "upload_id" in query:
      self._resume(h, method, query["upload_id"])
      return
    if method != "POST":
      raise Failed(405, f"{method} of an upload")
    body = h.body()
    if kind == "media":
      ctype = h.headers.get("Content-Type", "")
      h.reply_object(self.store.put(bucket, query.get("name", ""), body, query, ctype))
    elif kind == "multipart":
      meta, data, ctype = _multipart(body, h.headers.get("Content-Type", ""))
      name = query.get("name") or meta.get("name", "")
      h.reply_object(self.store.put(bucket, name, data, query, meta.get("contentType") or ctype,
                               meta.get("metadata")))
    elif kind == "resumable":
      meta = json.loads(body or b"{}")
      name = query.get("name") or meta.get("name", "")
      if not self.store.has_bucket(bucket):
        raise Failed(404, f"The specified bucket does not exist: {bucket}")
      upload_id = f"u{next(self._ids)}"
      self._uploads[upload_id] = {
          "bucket": bucket, "name": name, "query": query, "data": b"",
          "metadata": meta.get("metadata"),
          "ctype": meta.get("contentType") or h.headers.get("X-Upload-Content-Type", "")}
      location = (f"{self.url}/upload/storage/v1/b/{bucket}/o?uploadType=resumable"
                  f"&upload_id={upload_id}")
      h.reply(200, b"", {"Location": location})
    else:
      raise Failed(400, f"uploadType={kind} is not one this server knows")

  def _resume(self, h: Handler, method: str, upload_id: str) -> None:
    """A chunk of a resumable upload (`Content-Range: bytes a-b/total|*`); the object is
    written when the total has arrived, else 308 with the bytes received so far."""
  
    up = self._uploads.get(upload_id)
    if up is None:
      raise Failed(404, f"no such upload session: {upload_id}")
    chunk = h.body()
    if method == "DELETE":
      self._uploads.pop(upload_id, None)
      h.reply(499)
      return
    spec = h.headers.get("Content-Range", "").replace("bytes ", "").strip()
    span, _, total = spec.partition("/")
    if span not in ("", "*"):
      start = int(span.split("-")[0])
      up["data"] = up["data"][:start] + chunk
    elif chunk:
      up["data"] += chunk
    if total in ("", "*") or int(total) != len(up["data"]):
      headers = {"Range": f"bytes=0-{len(up['data']) - 1}"} if up["data"] else {}
      h.reply(308, b"", headers)
      return
    obj = self.store.put(up["bucket"], up["name"], up["data"], up["query"], up["ctype"],
                         up["metadata"])
    self._uploads.pop(upload_id, None)
    h.reply_object(obj)

"""The local GCS server of the tests (tests/gcs_server.py) answers as GCS's JSON API does
where the clients depend on it: generations, preconditions, ranges, listing pages."""

import base64
import json
import urllib.error
import urllib.request

import google_crc32c
import pytest

from tests.gcs_server import GcsServer


@pytest.fixture(scope="module")
def gcs():
  server = GcsServer().start()
  server.store.create_bucket("bkt")
  yield server
  server.stop()


def _call(gcs, method, path, data=None, headers=None):
  """(status, headers, body) of one request."""
  req = urllib.request.Request(gcs.url + path, data=data, method=method, headers=headers or {})
  try:
    with urllib.request.urlopen(req) as resp:
      return resp.status, resp.headers, resp.read()
  except urllib.error.HTTPError as e:
    return e.code, e.headers, e.read()


def _put(gcs, name, data, **pre):
  query = "".join(f"&{k}={v}" for k, v in pre.items())
  return _call(gcs, "POST", f"/upload/storage/v1/b/bkt/o?uploadType=media&name={name}{query}",
               data)


def test_generations_and_preconditions(gcs):
  status, _, body = _put(gcs, "a%2Fx", b"one", ifGenerationMatch=0)
  first = json.loads(body)
  assert status == 200 and first["metageneration"] == "1"
  assert first["crc32c"] == base64.b64encode(
      google_crc32c.value(b"one").to_bytes(4, "big")).decode()
  assert _put(gcs, "a%2Fx", b"two", ifGenerationMatch=0)[0] == 412  # Create only.
  status, _, body = _put(gcs, "a%2Fx", b"two", ifGenerationMatch=first["generation"])
  second = json.loads(body)
  assert status == 200 and int(second["generation"]) > int(first["generation"])
  assert _put(gcs, "a%2Fx", b"3", ifGenerationMatch=first["generation"])[0] == 412
  obj = "/storage/v1/b/bkt/o/a%2Fx"
  status, headers, body = _call(gcs, "GET", f"{obj}?alt=media", headers={"Range": "bytes=1-"})
  assert (status, body, headers["Content-Range"]) == (206, b"wo", "bytes 1-2/3")
  assert headers["x-goog-generation"] == second["generation"]
  assert _call(gcs, "GET", f"{obj}?alt=media&ifGenerationNotMatch={second['generation']}"
               )[0] == 304
  patch = json.dumps({"metadata": {"k": "v"}}).encode()
  assert _call(gcs, "PATCH", f"{obj}?ifMetagenerationMatch=2", patch)[0] == 412
  status, _, body = _call(gcs, "PATCH", f"{obj}?ifMetagenerationMatch=1", patch)
  assert status == 200 and json.loads(body)["metageneration"] == "2"
  assert json.loads(body)["generation"] == second["generation"]  # Metadata only.
  assert _call(gcs, "DELETE", f"{obj}?ifGenerationMatch={first['generation']}")[0] == 412
  assert _call(gcs, "DELETE", f"{obj}?ifGenerationMatch={second['generation']}")[0] == 204
  assert _call(gcs, "GET", obj)[0] == 404


def test_listing_pages_prefixes_and_a_resumable_upload(gcs):
  for name in ("l%2Fa", "l%2Fb%2F1", "l%2Fb%2F2", "l%2Fc"):
    assert _put(gcs, name, b"x")[0] == 200
  seen, token = [], ""
  while True:
    page = json.loads(_call(gcs, "GET", "/storage/v1/b/bkt/o?prefix=l/&delimiter=/"
                            f"&maxResults=1&pageToken={token}")[2])
    seen += [i["name"] for i in page["items"]] + page.get("prefixes", [])
    token = page.get("nextPageToken")
    if not token:
      break
  assert seen == ["l/a", "l/b/", "l/c"]
  status, headers, _ = _call(gcs, "POST", "/upload/storage/v1/b/bkt/o?uploadType=resumable"
                             "&name=r", b"{}")
  session = headers["Location"].replace(gcs.url, "")
  assert _call(gcs, "PUT", session, b"ab", {"Content-Range": "bytes 0-1/*"})[0] == 308
  status, _, body = _call(gcs, "PUT", session, b"c", {"Content-Range": "bytes 2-2/3"})
  assert status == 200 and json.loads(body)["size"] == "3"
  assert _call(gcs, "GET", "/download/storage/v1/b/bkt/o/r?alt=media")[2] == b"abc"

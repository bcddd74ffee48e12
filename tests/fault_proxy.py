"""An HTTP proxy that injects an object store's faults between its clients and a local
server (moto's S3, tests/storage_servers.py): what a bucket does to a pod run.

  proxy = FaultProxy("http://127.0.0.1:PORT", seed=0, throttle=0.03, lose=0.02, reset=0.02)
  threading.Thread(target=proxy.serve_forever, daemon=True).start()
  # clients: AWS_ENDPOINT_URL=http://127.0.0.1:<proxy.server_address[1]>

Three faults, each drawn per request from the proxy's own seeded generator:
- **throttle**: the request is answered `503 SlowDown` (S3's throttling error, an XML
  body as S3 sends) without reaching the server;
- **lose**: a write (PUT / POST) is forwarded, lands, and its connection is then closed
  unanswered: the client sees a reset or timeout after the server committed (the case
  that makes a retried conditional create meet its own object);
- **reset**: the connection is closed (RST) before the request is forwarded: nothing
  landed.
`lose_paths` (strings) makes the write whose path contains one of them lose its answer,
once per string, deterministically. `faults` counts what was injected; `puts` the
writes per path that reached the server; `requests` every request forwarded
(`object_gets`: those that read an object's bytes).
"""

from __future__ import annotations

import collections
import http.client
import http.server
import random
import socket
import struct
import threading

_SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")


class FaultProxy(http.server.ThreadingHTTPServer):
  """A proxy to `upstream` (http://host:port) that throttles, loses write answers and
  resets connections with the given probabilities (0: never)."""

  daemon_threads = True

  def __init__(self, upstream: str, seed: int = 0, throttle: float = 0.0, lose: float = 0.0,
               reset: float = 0.0):
    super().__init__(("127.0.0.1", 0), _Forward)
    self.upstream = upstream.split("://", 1)[-1]
    self.rates = {"throttle": throttle, "lose": lose, "reset": reset}
    self.rng = random.Random(seed)
    self.lose_paths: list[str] = []
    self.lost: list[str] = []
    self.puts: dict[str, int] = collections.Counter()
    self.faults: dict[str, int] = collections.Counter()
    self.requests: list[tuple[str, str]] = []  # (method, path) of each request forwarded.
    self.guard = threading.Lock()

  @property
  def url(self) -> str:
    return f"http://127.0.0.1:{self.server_address[1]}"

  def _draw(self, fault: str) -> bool:
    hit = self.rates[fault] > 0 and self.rng.random() < self.rates[fault]
    if hit:
      self.faults[fault] += 1
    return hit

  def before(self) -> str | None:
    """The fault injected before forwarding: "throttle", "reset" or None."""
    with self.guard:
      return next((f for f in ("throttle", "reset") if self._draw(f)), None)

  def object_gets(self) -> int:
    """GETs of an object's bytes forwarded so far (not listings: `?list-type`, `?prefix`)."""
    with self.guard:
      return sum(1 for method, path in self.requests if method == "GET" and "/" in
                 path.split("?")[0].strip("/") and "list-type" not in path)

  def loses_answer(self, path: str) -> bool:
    """After a write landed: whether its answer is dropped."""
    with self.guard:
      self.puts[path.split("?")[0]] += 1
      hit = next((s for s in self.lose_paths if s in path), None)
      if hit is not None:
        self.lose_paths.remove(hit)
      if hit is not None or self._draw("lose"):
        self.lost.append(path)
        return True
      return False


class _Forward(http.server.BaseHTTPRequestHandler):
  protocol_version = "HTTP/1.1"

  def _reset(self):
    """Closes the client's connection with a TCP reset (SO_LINGER 0), unanswered."""
    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    self.close_connection = True

  def _forward(self):
    length = int(self.headers.get("Content-Length") or 0)
    body = self.rfile.read(length) if length else None
    fault = self.server.before()
    if fault == "reset":
      return self._reset()
    if fault == "throttle":
      self.send_response(503)
      self.send_header("Content-Type", "application/xml")
      self.send_header("Content-Length", str(len(_SLOWDOWN)))
      self.end_headers()
      if self.command != "HEAD":
        self.wfile.write(_SLOWDOWN)
      return None
    with self.server.guard:
      self.server.requests.append((self.command, self.path))
    conn = http.client.HTTPConnection(self.server.upstream, timeout=60)
    conn.request(self.command, self.path, body=body, headers={
        k: v for k, v in self.headers.items() if k.lower() != "connection"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    if self.command in ("PUT", "POST") and self.server.loses_answer(self.path):
      return self._reset()  # Landed upstream; the client never hears of it.
    self.send_response(resp.status)
    for k, v in resp.getheaders():
      if k.lower() not in ("transfer-encoding", "connection", "content-length", "date",
                           "server"):
        self.send_header(k, v)
    self.send_header("Content-Length", resp.getheader("Content-Length", "0")
                     if self.command == "HEAD" else str(len(data)))
    self.end_headers()
    if self.command != "HEAD":
      self.wfile.write(data)
    return None

  do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

  def log_message(self, *args):  # A line per request otherwise.
    del args

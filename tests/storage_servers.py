"""Object-storage servers on localhost for the tests: moto's S3 server and
tests/gcs_server.py's GCS, started by the tests themselves (no network, no account).

The clients find them by their documented endpoint variables, set for the session
(this process and the subprocesses tests start): AWS_ENDPOINT_URL with fake
AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (botocore, so s3fs and orbax's TensorStore
path alike), STORAGE_EMULATOR_HOST (gcsfs), TENSORSTORE_GCS_HTTP_URL with a test token
(TensorStore's gcs driver, orbax's array writer). Fixtures, registered in tests/conftest.py:

  s3_server   session: the endpoint URL of a moto S3 server (If-None-Match: * honoured)
  s3_bucket   a fresh bucket: "s3://<name>"
  gcs_server  session: the endpoint of tests/gcs_server.py (generations, preconditions)
  gcs_bucket  a fresh bucket: "gs://<name>"
  bucket      a fresh bucket of each store, params ["s3", "gs"]: the run-level bucket
              tests run on both (test ids `...[s3]`, `...[gs]`)
  s3_lossy    (bucket, proxy): `s3_bucket` reached through a FaultProxy
              (tests/fault_proxy.py: throttling, lost answers, resets)

Each pytest-xdist worker starts its own servers (on free ports).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import threading
import time

import pytest

from tests.fault_proxy import FaultProxy

_names = itertools.count()


def free_port() -> int:
  with contextlib.closing(socket.socket()) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _wait_for(port: int, timeout_s: float = 20.0) -> None:
  deadline = time.time() + timeout_s
  while time.time() < deadline:
    with contextlib.closing(socket.socket()) as s:
      if s.connect_ex(("127.0.0.1", port)) == 0:
        return
    time.sleep(0.05)
  raise RuntimeError(f"no server came up on 127.0.0.1:{port} in {timeout_s} s")


@contextlib.contextmanager
def _env(**values: str):
  old = {k: os.environ.get(k) for k in values}
  os.environ.update(values)
  try:
    yield
  finally:
    for k, v in old.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


def _forget_filesystems() -> None:
  """fsspec caches a filesystem per protocol and options: a new endpoint needs a new one."""
  import fsspec  # pylint: disable=g-import-not-at-top
  for proto in ("s3", "gs"):
    try:
      fsspec.get_filesystem_class(proto).clear_instance_cache()
    except (ImportError, ValueError):
      pass
  try:  # etils.epath (orbax) keeps its own: forgotten too, so it shares storage's again.
    from etils.epath import backend  # pylint: disable=g-import-not-at-top
    backend._FileSystemSpecBackend._get_filesystem.cache_clear()  # pylint: disable=protected-access
  except (ImportError, AttributeError):
    pass


@contextlib.contextmanager
def _serving(server, port: int, env_for):
  """`server` started; while it runs, the variables `env_for(url)` names point at it."""
  server.start()
  try:
    _wait_for(port)
    url = f"http://127.0.0.1:{port}"
    with _env(**env_for(url)):
      _forget_filesystems()
      yield url
  finally:
    server.stop()
    _forget_filesystems()


@contextlib.contextmanager
def moto_s3():
  """A moto S3 server on a free localhost port; AWS_ENDPOINT_URL and fake credentials
  point botocore (s3fs, TensorStore's S3 driver) at it, so nothing reaches AWS."""
  from moto.server import ThreadedMotoServer  # pylint: disable=g-import-not-at-top
  port = free_port()
  logging.getLogger("werkzeug").setLevel(logging.WARNING)  # A line per request otherwise.
  server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
  with _serving(server, port, lambda url: dict(
      AWS_ENDPOINT_URL=url, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
      AWS_DEFAULT_REGION="us-east-1", AWS_SESSION_TOKEN="testing",
      AWS_EC2_METADATA_DISABLED="true")) as url:
    yield url


@pytest.fixture(scope="session")
def s3_server():
  pytest.importorskip("s3fs")
  pytest.importorskip("moto.server")
  with moto_s3() as url:
    yield url


@pytest.fixture
def s3_bucket(s3_server):
  import s3fs  # pylint: disable=g-import-not-at-top
  name = f"blockwork-test-{os.getpid()}-{next(_names)}"
  s3fs.S3FileSystem().mkdir(name)
  return f"s3://{name}"


@contextlib.contextmanager
def serving(proxy):
  """`proxy` (tests/fault_proxy.py's FaultProxy) answering in a thread while in use."""
  thread = threading.Thread(target=proxy.serve_forever, daemon=True)
  thread.start()
  try:
    yield proxy
  finally:
    proxy.shutdown()
    proxy.server_close()


@pytest.fixture
def s3_lossy(s3_server, s3_bucket):
  """(s3_bucket, its FaultProxy, no random faults): the S3 clients of this process reach
  moto through the proxy while the test runs; `proxy.lose_paths` picks the writes whose
  answers are lost."""
  with serving(FaultProxy(s3_server)) as proxy, _env(AWS_ENDPOINT_URL=proxy.url):
    _forget_filesystems()
    try:
      yield s3_bucket, proxy
    finally:
      _forget_filesystems()


@contextlib.contextmanager
def local_gcs():
  """tests/gcs_server.py's GCS on a free localhost port; STORAGE_EMULATOR_HOST (gcsfs)
  and TENSORSTORE_GCS_HTTP_URL with a test token (TensorStore's gcs driver) point at it,
  so nothing reaches Google."""
  from tests.gcs_server import GcsServer  # pylint: disable=g-import-not-at-top
  server = GcsServer()
  port = server.server_address[1]
  with _serving(server, port, lambda url: dict(
      STORAGE_EMULATOR_HOST=url, TENSORSTORE_GCS_HTTP_URL=url,
      GOOGLE_AUTH_TOKEN_FOR_TESTING="blockwork-test")) as url:
    yield url


@pytest.fixture(scope="session")
def gcs_server():
  pytest.importorskip("gcsfs")
  with local_gcs() as url:
    yield url


@pytest.fixture
def gcs_bucket(gcs_server):
  import gcsfs  # pylint: disable=g-import-not-at-top
  name = f"blockwork-test-{os.getpid()}-{next(_names)}"
  gcsfs.GCSFileSystem(token="anon").mkdir(name)
  return f"gs://{name}"


@pytest.fixture(params=["s3", "gs"])
def bucket(request):
  """A fresh bucket URL on moto's S3 server, then on the local GCS server, with the
  clients' endpoint variables set: each test that takes it runs on both stores."""
  return request.getfixturevalue("s3_bucket" if request.param == "s3" else "gcs_bucket")

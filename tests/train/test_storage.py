"""train/io/storage.py against a local path, memory://, moto's S3 server and the local
GCS server (tests/gcs_server.py)."""

import os

import pytest

from train.io import conditional, staging, storage


@pytest.fixture(params=["local", "memory", "s3", "gcs"])
def root(request, tmp_path):
  if request.param == "local":
    return str(tmp_path)
  if request.param == "memory":
    return f"memory://storage-test-{tmp_path.name}"
  return request.getfixturevalue("s3_bucket" if request.param == "s3" else "gcs_bucket")


def test_write_read_list_delete_round_trip(root):
  run = storage.join(root, "run")
  storage.makedirs(run)
  assert not storage.exists(storage.join(run, "config.json"))
  storage.write_text(storage.join(run, "config.json"), '{"a": 1}')
  storage.write_bytes(storage.join(run, "logs", "0001.jsonl"), b"x\n")
  assert storage.read_text(storage.join(run, "config.json")) == '{"a": 1}'
  storage.write_text(storage.join(run, "config.json"), '{"a": 2}')  # Replaced whole.
  assert storage.read_text(storage.join(run, "config.json")) == '{"a": 2}'
  assert storage.listdir(run) == ["config.json", "logs"]
  assert storage.isdir(storage.join(run, "logs"))
  assert storage.glob(storage.join(run, "logs", "*.jsonl")) == [
      storage.join(run, "logs", "0001.jsonl")]
  with pytest.raises(FileNotFoundError, match="nothing.json"):
    storage.read_bytes(storage.join(run, "nothing.json"))
  storage.delete(storage.join(run, "config.json"))
  storage.delete(storage.join(run, "config.json"))  # Absent: fine.
  assert not storage.exists(storage.join(run, "config.json"))
  assert storage.listdir(storage.join(run, "absent")) == []


def test_create_exclusive_creates_once(root):
  path = storage.join(root, "LOCK")
  storage.makedirs(root)
  assert conditional.create_exclusive(path, b"first")
  assert not conditional.create_exclusive(path, b"second")
  assert storage.read_bytes(path) == b"first"


def test_conditional_replace_and_delete_take_only_the_version_read(root):
  """The store's compare-and-swap (S3 If-Match on the ETag, GCS ifGenerationMatch on
  the generation, locally the bytes under a flock): a stale version changes nothing."""
  path = storage.join(root, "run", "LOCK")
  storage.makedirs(storage.join(root, "run"))
  first = conditional.create(path, b"first")
  assert first is not None and conditional.read(path).version == first
  second = conditional.replace_if(path, b"second", first)
  assert second is not None and second != first
  assert conditional.replace_if(path, b"stale", first) is None
  assert not conditional.delete_if(path, first)  # Not the version there: kept.
  assert storage.read_bytes(path) == b"second"
  assert conditional.delete_if(path, second)
  assert not storage.exists(path)


def test_a_missing_bucket_names_the_url_and_the_operation(s3_server):
  url = "s3://no-such-bucket-blockwork/run/config.json"
  with pytest.raises(storage.StorageError, match="write s3://no-such-bucket-blockwork/run/"
                     "config.json: no such bucket"):
    storage.write_text(url, "{}")


def test_a_throttled_request_is_retried_with_backoff_then_named(monkeypatch):
  calls = []
  monkeypatch.setattr(storage, "BACKOFF_S", 0.0)

  def throttled():
    calls.append(1)
    raise OSError("SlowDown: Please reduce your request rate")
  with pytest.raises(storage.StorageError, match=r"read s3://b/x: throttled or unavailable "
                     r"after 4 attempts"):
    storage._remote("read", "s3://b/x", throttled)  # pylint: disable=protected-access
  assert len(calls) == storage.RETRIES

  def once():
    calls.append(1)
    if len(calls) == storage.RETRIES + 1:
      raise ConnectionError("reset")
    return "ok"
  assert storage._remote("read", "s3://b/x", once) == "ok"  # pylint: disable=protected-access


def test_requests_are_counted():
  before = storage.request_count()
  storage.write_text("memory://count-test/a", "x")
  storage.read_text("memory://count-test/a")
  assert storage.request_count() - before == 2


def test_walk_relpath_upload_and_staged_copies(root, tmp_path):
  run = storage.join(root, "sweep", "a")
  storage.write_text(storage.join(run, "config.json"), "{}")
  storage.write_text(storage.join(run, "tokenizer", "spm.model"), "model")
  found = {storage.relpath(here, storage.join(root, "sweep")): sorted(files)
           for here, _, files in storage.walk(storage.join(root, "sweep"))}
  assert found == {".": [], "a": ["config.json"], "a/tokenizer": ["spm.model"]}
  local = tmp_path / "out"
  (local / "sub").mkdir(parents=True)
  (local / "sub" / "x.png").write_bytes(b"png")
  assert staging.upload_dir(str(local), storage.join(root, "report")) == [
      storage.join(root, "report", "sub", "x.png")]
  assert storage.read_bytes(storage.join(root, "report", "sub", "x.png")) == b"png"
  with staging.staged(run, "tokenizer") as here:  # A library's view: local files.
    with open(os.path.join(here, "tokenizer", "spm.model")) as f:
      assert f.read() == "model"
    with open(os.path.join(here, "tokenizer", "new.json"), "w") as f:
      f.write("new")  # Gained: uploaded on exit.
  assert storage.read_text(storage.join(run, "tokenizer", "new.json")) == "new"


def test_read_many_keeps_the_order_and_names_a_missing_object(root):
  paths = [storage.join(root, "log", f"{i:08d}.jsonl") for i in (2, 1, 3)]
  for i, p in enumerate(paths):
    storage.write_bytes(p, b"%d" % i)
  assert storage.read_many(paths) == [b"0", b"1", b"2"]
  with pytest.raises(FileNotFoundError, match="absent"):
    storage.read_many([paths[0], storage.join(root, "log", "absent")])

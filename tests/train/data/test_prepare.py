"""--mode prepare: every input format, the hash hold-out, bad input, resume, and reading
the result locally and through an object-store stand-in (fsspec)."""

import hashlib
import importlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import fsspec
import numpy as np
import pytest
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem

from experiments.configs.base import get_config
from tests.cli import ROOT, launch
from tests.train.data import corpus_files
from train.data import prepared
from train.data.formats import PrepareError
from train.data.pipeline import make_source
from train.data.prepare import prepare
from train.io import dataset_store


def _docs(stream) -> list[str]:
  """Every document of a prepared split, decoded (byte tokenizer: tokens are bytes)."""
  out = []
  for i in range(len(stream.shards)):
    tokens = np.asarray(stream._tokens(i))
    bounds = list(stream.starts(i)) + [len(tokens)]
    nbytes = stream.doc_bytes(i)
    for j in range(len(bounds) - 1):
      doc = bytes(tokens[bounds[j]:bounds[j + 1]].astype(np.uint8))
      assert len(doc) == nbytes[j]  # Per-document UTF-8 bytes, as recorded.
      out.append(doc.decode("utf-8"))
  return out


def _data(corpus, **kw):
  d = get_config().data
  d.update(corpus=corpus, **kw)
  return d


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  root = tmp_path_factory.mktemp("prepare")
  texts = corpus_files.all_formats(str(root))
  out = str(root / "ds")
  out_text = launch("--mode", "prepare", "--input", f"{root}/mixed,{root}/hf_saved",
                    "--output", out, "--config.data.val_fraction=0.2", "--prepare_workers=2")
  return root, texts, out, out_text


def test_every_format_prepares_to_its_documents_split_without_overlap(corpus):
  root, texts, out, printed = corpus
  assert "prepared" in printed and "--config.data.corpus=" in printed
  manifest = json.load(open(os.path.join(out, "manifest.json")))
  store = prepared.Store(out)
  train, val = (_docs(prepared.PreparedStream(store, manifest, s)) for s in ("train", "validation"))
  every = [t for docs in texts.values() for t in docs]
  assert sorted(train + val) == sorted(every) and not set(train) & set(val)
  assert 0.1 < len(val) / len(every) < 0.3  # val_fraction=0.2 by hash of identity.
  kinds = {s["kind"] for s in manifest["sources"]}
  assert kinds == {"text", "jsonl", "parquet", "arrow"}
  for src in manifest["sources"]:  # Sizes and hashes of what was read.
    assert src["size"] == os.path.getsize(src["path"])
    assert src["sha256"] == hashlib.sha256(open(src["path"], "rb").read()).hexdigest()
  assert manifest["splits"]["train"]["bytes"] == sum(len(t.encode()) for t in train)
  assert manifest["tokenizer"]["fingerprint"].startswith("byte-") and manifest["dtype"] == "uint8"
  assert "--mode" in manifest["command"] and manifest["skipped"] == {}


def test_workers_do_not_change_the_result_and_new_files_move_nothing(corpus, tmp_path):
  root, _, out, _ = corpus
  extra = tmp_path / "more"
  shutil.copytree(root / "mixed", extra)
  corpus_files.write_jsonl(str(extra / "z_new.jsonl"), corpus_files.documents("new", 30))
  m2 = prepare([str(extra), str(root / "hf_saved")], str(tmp_path / "ds2"), val_fraction=0.2,
               workers=0, progress=False)
  m1 = json.load(open(os.path.join(out, "manifest.json")))
  s1, s2 = prepared.Store(out), prepared.Store(str(tmp_path / "ds2"))
  val1 = _docs(prepared.PreparedStream(s1, m1, "validation"))
  val2 = _docs(prepared.PreparedStream(s2, m2, "validation"))
  assert set(val1) <= set(val2)  # Old documents keep their split; only new ones are added.
  assert all(t.startswith("new") for t in set(val2) - set(val1))
  for name in (s["name"] for s in m1["splits"]["train"]["shards"]):  # Same bytes, 0 workers.
    a = open(os.path.join(out, "shards", f"{name}.tokens"), "rb").read()
    assert a == open(tmp_path / "ds2" / "shards" / f"{name}.tokens", "rb").read()


def test_progress_line_shows_documents_tokens_text_mb_rate_and_eta(tmp_path, capsys):
  """Text MB are the documents' own (uncompressed) bytes, input MB the file's; a finished
  dataset keeps no resume state (ledger.jsonl, plan.json)."""
  zstd = pytest.importorskip("zstandard")
  docs = corpus_files.documents("p", 50)
  corpus_files.write_jsonl(str(tmp_path / "a.jsonl"), docs)
  raw = (tmp_path / "a.jsonl").read_bytes()
  (tmp_path / "a.jsonl.zst").write_bytes(zstd.ZstdCompressor().compress(raw * 400))
  prepare([str(tmp_path / "a.jsonl.zst")], str(tmp_path / "o"), workers=0, val_fraction=0.2)
  line = capsys.readouterr().err.strip().splitlines()[-1]
  text_mb = 400 * sum(len(d.encode()) for d in docs) / 1e6
  input_mb = (tmp_path / "a.jsonl.zst").stat().st_size / 1e6
  assert text_mb > 10 * input_mb  # Compressed: the two must not be confused.
  assert re.search(rf"1/1 files +20,000 docs +[\d.]+M tokens +{text_mb:.1f} MB text "
                   rf"\([\d.]+ MB/s\) +input {input_mb:.1f}/{input_mb:.1f} MB +done in \d+m\d\ds$",
                   line), line
  assert sorted(os.listdir(tmp_path / "o")) == ["manifest.json", "shards"]  # Byte: no tokenizer/.


def test_the_eta_scales_the_time_so_far_by_the_input_left(monkeypatch):
  from train.data import prepare_out  # pylint: disable=g-import-not-at-top
  clock = [100.0]
  monkeypatch.setattr(prepare_out.time, "monotonic", lambda: clock[0])
  bar = prepare_out.Progress(total_bytes=4_000, num_sources=2, sources_done=0, enabled=False)
  clock[0] += 30
  bar.update(1_000, 5_000, docs=10, tokens=5_000)  # A quarter of the input in 30 s.
  assert bar.eta() == pytest.approx(90.0) and bar.text == 5_000
  bar.source_done(2_000)  # The rest of the first file went in its last chunk.
  clock[0] += 10
  assert bar.eta() == pytest.approx(40.0)  # Half done in 40 s.


def test_no_eta_is_printed_before_enough_is_measured(monkeypatch, capsys):
  """Issue 46 item 8: an 18 s job printed "ETA 10m02s" from its first chunk (start-up
  included); the ETA waits for Progress.MIN_MEASURED of the input, the last line says
  how long it took."""
  from train.data import prepare_out  # pylint: disable=g-import-not-at-top
  clock = [0.0]
  monkeypatch.setattr(prepare_out.time, "monotonic", lambda: clock[0])
  bar = prepare_out.Progress(total_bytes=1_000_000, num_sources=1, sources_done=0,
                             enabled=True)
  clock[0] += 2.0
  bar.update(3_000, 3_000, docs=1, tokens=3_000)  # 0.3% in 2 s: would say 11m05s.
  assert bar.eta() is None
  clock[0] += 7.0
  bar.update(500_000, 500_000, docs=100, tokens=500_000)  # Half in 9 s.
  assert bar.eta() == pytest.approx(9.0)
  clock[0] += 9.0
  bar.source_done(1_000_000)
  bar.close()
  lines = capsys.readouterr().err.splitlines()
  assert lines[0].endswith("ETA (measuring)") and lines[1].endswith("ETA 0m09s"), lines
  assert lines[2].endswith("done in 0m18s") and "ETA" not in lines[2], lines


def test_bad_records_name_file_and_line_or_are_skipped_and_counted(tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_bytes(b'{"text": "fine"}\n{"text": broken\n{"body": "x"}\n{"text": "\xff"}\n' +
                   b"".join(b'{"text": "doc %d"}\n' % i for i in range(40)))
  with pytest.raises(PrepareError, match=rf"{path}:2: not valid JSON"):
    prepare([str(path)], str(tmp_path / "o1"), workers=0, progress=False)
  m = prepare([str(path)], str(tmp_path / "o2"), workers=0, progress=False,
              skip_bad_records=True, val_fraction=0.1)
  assert m["skipped"] == {"bad_json": 1, "missing_field": 1, "bad_utf8": 1}
  assert sum(s["documents"] for s in m["splits"].values()) == 41
  with pytest.raises(PrepareError, match="matches no files"):
    prepare([str(tmp_path / "*.parquet")], str(tmp_path / "o3"), progress=False)
  with pytest.raises(PrepareError, match="no column 'body'"):
    corpus_files.write_parquet(str(tmp_path / "t.parquet"), ["a", "b"])
    prepare([str(tmp_path / "t.parquet")], str(tmp_path / "o4"), text_field="body",
            workers=0, progress=False)
  if importlib.util.find_spec("datasets") is None:  # Not in the default install.
    with pytest.raises(PrepareError, match="needs the `datasets` package"):
      prepare(["hf:user/corpus"], str(tmp_path / "o6"), workers=0, progress=False)
  with pytest.raises(PrepareError, match=r"bad.jsonl:2: "):  # launch.py prints it as one line.
    launch("--mode", "prepare", "--input", str(path), "--output", str(tmp_path / "o5"))


def test_a_failed_prepare_is_never_read_and_resumes_after_its_finished_sources(tmp_path, caplog):
  src = tmp_path / "src"
  src.mkdir()
  for k in range(3):
    corpus_files.write_jsonl(str(src / f"p{k}.jsonl"), corpus_files.documents(f"part{k}", 30))
  good = (src / "p2.jsonl").read_bytes()
  (src / "p2.jsonl").write_bytes(good + b"not json\n")
  out = str(tmp_path / "ds")
  with pytest.raises(PrepareError, match="p2.jsonl:31"):
    prepare([str(src)], out, workers=0, progress=False, val_fraction=0.2)
  assert not os.path.exists(out) and os.path.isdir(out + ".partial")
  with pytest.raises(ValueError, match="half-written"):
    make_source(_data(out + ".partial"), None)
  with pytest.raises(PrepareError, match="other inputs or options"):
    prepare([str(src)], out, workers=0, progress=False, val_fraction=0.3)
  (src / "p2.jsonl").write_bytes(good)  # The user fixes the file and runs it again.
  with caplog.at_level("INFO"):
    resumed = prepare([str(src)], out, workers=0, progress=False, val_fraction=0.2)
  assert "2 of 3 sources already done" in caplog.text
  fresh = prepare([str(src)], str(tmp_path / "fresh"), workers=0, progress=False,
                  val_fraction=0.2)
  assert resumed["splits"] == fresh["splits"] and not os.path.exists(out + ".partial")
  with pytest.raises(PrepareError, match="already a prepared dataset"):
    prepare([str(src)], out, workers=0, progress=False)


class _LocalBucket(DirFileSystem):
  """The object-store stand-in: fsspec's own DirFileSystem over a local directory,
  registered as the "gs" protocol, so gs://bucket/x is read through fsspec's remote
  code path (cat_file byte ranges, ls), exactly as gcsfs is."""
  protocol = ("gs",)
  root = ""
  token_bytes_read = 0  # What byte-range reads of token shards fetched, in all.

  def __init__(self, *args, **kw):
    super().__init__(path=self.root, fs=LocalFileSystem(), **kw)

  def cat_file(self, path, start=None, end=None, **kw):
    out = super().cat_file(path, start=start, end=end, **kw)
    if path.endswith(".tokens"):
      type(self).token_bytes_read += len(out)
    return out


@pytest.fixture()
def bucket(tmp_path, monkeypatch):
  monkeypatch.setattr(_LocalBucket, "root", str(tmp_path / "bucket"))
  fsspec.register_implementation("gs", _LocalBucket, clobber=True)
  yield tmp_path / "bucket"
  importlib.import_module("fsspec.registry")._registry.pop("gs", None)  # pylint: disable=protected-access


def test_object_store_reads_the_same_batches_and_refuses_damage(corpus, bucket):
  _, _, out, _ = corpus
  shutil.copytree(out, bucket / "b" / "ds")
  local, remote = make_source(_data(out), None), make_source(_data("gs://b/ds"), None)
  assert isinstance(remote.train._tokens(0), dataset_store.RangeArray)  # Byte ranges, not files.
  for host in range(2):  # Each host's rows of the same global batches.
    a = local.train_dataset(3, 8, 32, host, 2)
    b = remote.train_dataset(3, 8, 32, host, 2)
    before = _LocalBucket.token_bytes_read
    for k in range(3):
      want, got = a[k], b[k]
      for key in want:
        np.testing.assert_array_equal(want[key], got[key])
    # Only its 4 rows of each batch were fetched: 33 one-byte tokens per window (two
    # ranges where a window crosses a shard), never the shards themselves.
    assert _LocalBucket.token_bytes_read - before <= 3 * 4 * 33
  ev_a, ev_b = local.eval_batches(4, 32, 2), remote.eval_batches(4, 32, 2)
  np.testing.assert_array_equal(ev_a[1]["inputs"], ev_b[1]["inputs"])
  with pytest.raises(ValueError, match=r"byte-\w+.*sentencepiece-\w+|sentencepiece-\w+.*byte-"):
    spm = _data("gs://b/ds", tokenizer="sentencepiece", vocab_size=300,
                spm_model=str(bucket / "m.model"))
    _train_spm(str(bucket / "m.model"))
    make_source(spm, None)
  shard = bucket / "b" / "ds" / "shards" / "train-00000.tokens"
  shard.write_bytes(shard.read_bytes()[:-2])
  with pytest.raises(ValueError, match="train-00000.tokens has .* the manifest says"):
    make_source(_data("gs://b/ds"), None)
  os.remove(bucket / "b" / "ds" / "manifest.json")
  with pytest.raises(ValueError, match="no manifest.json"):
    make_source(_data("gs://b/ds"), None)


def _train_spm(path):
  from train.data.tokenizers import SentencePieceTokenizer  # pylint: disable=g-import-not-at-top
  SentencePieceTokenizer.train(corpus_files.documents("spm", 200), 300).save(path)


def test_sentencepiece_prepare_keeps_bits_per_byte_exact(tmp_path):
  src = tmp_path / "code.jsonl"
  corpus_files.write_jsonl(str(src), corpus_files.documents("code", 120))
  m = prepare([str(src)], str(tmp_path / "ds"), tokenizer="sentencepiece", vocab_size=300,
              sample_bytes=4000, workers=0, progress=False, val_fraction=0.2)
  source = make_source(_data(str(tmp_path / "ds"), tokenizer="sentencepiece", vocab_size=300),
                       str(tmp_path / "run"))
  assert os.path.isfile(tmp_path / "run" / "tokenizer" / "spm.model")  # Cached in the run.
  stream, tb = source.train, source.tokenizer.token_bytes
  tokens = np.asarray(stream._tokens(0))
  assert int(tb[tokens].sum()) == m["splits"]["train"]["bytes"]  # bpb's denominator is exact.
  assert stream.starts(0)[1] > 0 and tokens[stream.starts(0)[1] - 1] == source.tokenizer.eos_id


def test_a_killed_prepare_resumes_to_the_same_dataset(tmp_path):
  """SIGKILL mid-prepare (after its first finished file): the rerun resumes after the
  files the ledger lists and ends with what an uninterrupted prepare writes."""
  src = tmp_path / "src"
  src.mkdir()
  for k in range(30):
    corpus_files.write_jsonl(str(src / f"p{k:02d}.jsonl"),
                             corpus_files.documents(f"part{k}", 300, words=40))
  out = tmp_path / "ds"
  code = (f"from train.data.prepare import prepare; prepare([{str(src)!r}], {str(out)!r}, "
          "workers=0, progress=False, val_fraction=0.2)")
  proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
  ledger = out.parent / "ds.partial" / "ledger.jsonl"
  deadline = time.monotonic() + 120
  while proc.poll() is None and time.monotonic() < deadline:
    if ledger.exists() and ledger.read_text().count("\n") >= 1:
      proc.send_signal(signal.SIGKILL)
      break
    time.sleep(0.005)
  proc.wait()
  assert proc.returncode == -signal.SIGKILL, "prepare finished before it could be killed"
  assert not out.exists()
  finished = ledger.read_text().count("\n")
  assert 1 <= finished < 30
  resumed = prepare([str(src)], str(out), workers=0, progress=False, val_fraction=0.2)
  fresh = prepare([str(src)], str(tmp_path / "fresh"), workers=0, progress=False,
                  val_fraction=0.2)
  assert resumed["splits"] == fresh["splits"]
  for shard in fresh["splits"]["train"]["shards"]:
    name = f"{shard['name']}.tokens"
    assert (out / "shards" / name).read_bytes() == (tmp_path / "fresh" / "shards" / name).read_bytes()

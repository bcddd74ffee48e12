"""Data pipeline: corpora splits, packing, grain iterator state, per-host shards."""

import json
import os

import numpy as np
import pytest

from experiments.configs.base import get_config
from train.data import corpora
from train.data.packing import num_windows, pack_window
from train.data.pipeline import make_source
from train.data.streams import TokenStream
from train.data.token_source import DataSource
from train.data.tokenizers import SPM_FILE, ByteTokenizer
from train.eval.evaluator import bits_per_byte, target_bytes

KEYS = {"inputs": np.int32, "targets": np.int32, "positions": np.int32,
        "segment_ids": np.int32, "weights": np.float32}


def _cfg(**kw):
  c = get_config().data
  c.update(kw)
  return c


@pytest.fixture(scope="module")
def shakespeare():
  return make_source(_cfg(), None)


def _check_packing(batch, stream_doc_of=None):
  """Properties every window must satisfy, whatever the corpus."""
  for key, dtype in KEYS.items():
    assert batch[key].dtype == dtype and batch[key].shape == batch["inputs"].shape, key
  inp, tgt, pos, seg, w = (batch[k] for k in ("inputs", "targets", "positions",
                                              "segment_ids", "weights"))
  same = (seg[..., 1:] == seg[..., :-1]) & (seg[..., 1:] > 0)
  # Inside a segment the target is the next input and positions count up by 1.
  np.testing.assert_array_equal(np.where(same, tgt[..., :-1], 0), np.where(same, inp[..., 1:], 0))
  np.testing.assert_array_equal(np.where(same, pos[..., 1:] - pos[..., :-1], 1), 1)
  # A new segment starts at position 0, with segment ids counting up from 1.
  starts = np.concatenate([np.ones_like(seg[..., :1], bool), ~same], -1) & (seg > 0)
  np.testing.assert_array_equal(pos[starts], 0)
  assert np.all(seg[..., 0] == 1) and np.all(np.diff(seg, axis=-1)[same] == 0)
  # Weight 0 exactly where the target leaves the segment (or is padding).
  np.testing.assert_array_equal(w[..., :-1], same.astype(np.float32) * (seg[..., :-1] > 0))


def _stream(doc_lens, eos_id=None):
  tokens = np.concatenate([np.arange(n) + 10 * (d + 1) for d, n in enumerate(doc_lens)])
  starts = np.cumsum([0] + list(doc_lens[:-1]))
  return TokenStream([tokens.astype(np.int32)], doc_starts=starts, eos_id=eos_id), tokens


def test_pack_window_hand_computed():
  stream, _ = _stream([3, 4])  # Tokens 10 11 12 | 20 21 22 23.
  w0 = pack_window(stream, 0, 4, 256)  # Covers 10 11 12 20 (+ 21 as last target).
  np.testing.assert_array_equal(w0["inputs"], [10, 11, 12, 20])
  np.testing.assert_array_equal(w0["targets"], [11, 12, 20, 21])
  np.testing.assert_array_equal(w0["segment_ids"], [1, 1, 1, 2])
  np.testing.assert_array_equal(w0["positions"], [0, 1, 2, 0])
  np.testing.assert_array_equal(w0["weights"], [1, 1, 0, 1])
  w1 = pack_window(stream, 1, 4, 256)  # 21 22 23, then padding; continues doc 2 at position 0.
  np.testing.assert_array_equal(w1["inputs"], [21, 22, 23, 0])
  np.testing.assert_array_equal(w1["targets"], [22, 23, 0, 0])
  np.testing.assert_array_equal(w1["segment_ids"], [1, 1, 1, 0])
  np.testing.assert_array_equal(w1["positions"], [0, 1, 2, 0])
  np.testing.assert_array_equal(w1["weights"], [1, 1, 0, 0])  # 23's target is padding.
  assert num_windows(7, 4) == 2
  with pytest.raises(IndexError):
    pack_window(stream, 2, 4, 256)
  with pytest.raises(ValueError, match="outside the tokenizer's vocabulary"):
    pack_window(stream, 0, 4, 16)


@pytest.mark.parametrize("seq_len", [1, 3, 8, 40])
def test_packing_covers_every_transition_once(seq_len):
  doc_lens = [5, 1, 12, 7, 2]
  stream, tokens = _stream(doc_lens)
  windows = [pack_window(stream, i, seq_len, 256) for i in range(num_windows(len(tokens), seq_len))]
  batch = {k: np.stack([w[k] for w in windows]) for k in KEYS}
  _check_packing(batch)
  # Every in-document transition (t -> t+1) is weighted exactly once, none across documents.
  w = batch["weights"] > 0
  pairs = sorted(zip(batch["inputs"][w].tolist(), batch["targets"][w].tolist()))
  doc = np.repeat(np.arange(len(doc_lens)), doc_lens)
  want = sorted((int(a), int(b)) for a, b, da, db in zip(tokens[:-1], tokens[1:], doc[:-1], doc[1:])
                if da == db)
  assert pairs == want


def test_eos_marks_document_boundaries():
  # A .bin stream has no document list: the token after EOS (id 1) starts a document.
  stream = TokenStream([np.array([5, 6, 1, 7, 8, 1, 9], np.uint16)], eos_id=1)
  w = pack_window(stream, 0, 6, 256)
  np.testing.assert_array_equal(w["segment_ids"], [1, 1, 1, 2, 2, 2])
  np.testing.assert_array_equal(w["positions"], [0, 1, 2, 0, 1, 2])
  np.testing.assert_array_equal(w["weights"], [1, 1, 0, 1, 1, 0])
  w = pack_window(stream, 1, 3, 256)  # Starts right after an EOS, seen across the window edge.
  np.testing.assert_array_equal(w["segment_ids"], [1, 1, 1])
  np.testing.assert_array_equal(w["weights"], [1, 1, 0])


def test_strip_gutenberg():
  text = ("The Project Gutenberg EBook of X\nlicence\n"
          "*** START OF THIS PROJECT GUTENBERG EBOOK X ***\n\nACT I.\nHello.\n"
          "*** END OF THIS PROJECT GUTENBERG EBOOK X ***\nmore licence\n")
  assert corpora.strip_gutenberg(text) == "ACT I.\nHello.\n"
  assert corpora.strip_gutenberg("ACT I.\nHello.") == "ACT I.\nHello."


def test_shakespeare_split_by_work(shakespeare):
  works = corpora.shakespeare_works()
  assert len(works) == 42 and not any(n.endswith("_f") for n in works)
  train, val = corpora.split_shakespeare(4)
  assert val.names == ["as_you_like_it", "henry_iv_part_1", "romeo_and_juliet", "sonnets"]
  assert (train, val) == corpora.split_shakespeare(4)  # Deterministic.
  assert not set(val.names) & set(train.names) and len(train.names) == 38
  train_text = "\n".join(train.texts)
  assert all(text[1000:1200] not in train_text for text in val.texts)
  # The byte source holds exactly these texts, one segment per work.
  assert len(shakespeare.train) == sum(len(t.encode()) for t in train.texts)
  assert len(shakespeare.val) == sum(len(t.encode()) for t in val.texts)
  assert shakespeare.info["val_documents"] == val.names


def test_iterator_state_resumes_exactly(shakespeare):
  it = shakespeare.train_iterator(seed=7, batch_size=4, seq_len=16)
  first = [next(it) for _ in range(3)]
  state = json.loads(json.dumps(it.get_state()))  # Must survive a JSON checkpoint.
  after = [next(it) for _ in range(2)]
  fresh = shakespeare.train_iterator(seed=7, batch_size=4, seq_len=16)
  fresh.set_state(state)
  for a, b in zip(after, [next(fresh) for _ in range(2)]):
    for k in KEYS:
      np.testing.assert_array_equal(a[k], b[k])
  for batch in first + after:
    _check_packing(batch)
  again = next(shakespeare.train_iterator(seed=7, batch_size=4, seq_len=16))
  other = next(shakespeare.train_iterator(seed=8, batch_size=4, seq_len=16))
  np.testing.assert_array_equal(again["inputs"], first[0]["inputs"])
  assert not np.array_equal(other["inputs"], first[0]["inputs"])


def _window_ids(ds, steps, seq_len):
  """Which window each row of batches [0, steps) is (tokens are arange, so the
  first input names the window)."""
  return np.concatenate([ds[k]["inputs"][:, 0] // seq_len for k in range(steps)])


def test_epochs_cover_all_windows_and_reshuffle():
  stream = TokenStream([np.arange(101, dtype=np.int32)], doc_starts=[0, 50, 80])
  src = DataSource(ByteTokenizer(), stream, stream)
  assert num_windows(101, 10) == 10
  ids = _window_ids(src.train_dataset(seed=0, batch_size=5, seq_len=10), 4, 10)
  assert sorted(ids[:10]) == list(range(10)) and sorted(ids[10:]) == list(range(10))
  assert not np.array_equal(ids[:10], ids[10:])  # A new order each epoch.
  # shuffle_buffer=N shuffles only within consecutive blocks of N windows.
  src.shuffle_buffer = 5
  ids = _window_ids(src.train_dataset(seed=0, batch_size=5, seq_len=10), 4, 10)
  assert [sorted(ids[i:i + 5]) for i in (0, 5, 10, 15)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]] * 2
  assert list(ids[:10]) != list(range(10))


@pytest.mark.parametrize("count", [2, 4])
def test_host_shards_concatenate_to_global_batch(shakespeare, count):
  whole = shakespeare.train_dataset(seed=3, batch_size=8, seq_len=16, process_count=1)
  hosts = [shakespeare.train_iterator(3, 8, 16, process_index=p, process_count=count)
           for p in range(count)]
  for step in range(3):
    local = [next(it) for it in hosts]
    assert local[0]["inputs"].shape == (8 // count, 16)
    for k in KEYS:
      np.testing.assert_array_equal(np.concatenate([b[k] for b in local]), whole[step][k])
  with pytest.raises(ValueError, match="batch_size=6 must be a positive multiple"):
    shakespeare.train_iterator(0, 6, 16, process_index=0, process_count=4)
  with pytest.raises(ValueError, match="process_index=4"):
    shakespeare.train_iterator(0, 8, 16, process_index=4, process_count=4)


def test_eval_batches_fixed_sharded_and_longer(shakespeare):
  a = shakespeare.eval_batches(batch_size=4, seq_len=64, num_batches=3)
  b = shakespeare.eval_batches(batch_size=4, seq_len=64, num_batches=3)
  assert len(a) == 3 and a[0]["inputs"].shape == (4, 64)
  for x, y in zip(a, b):
    for k in KEYS:
      np.testing.assert_array_equal(x[k], y[k])
    _check_packing(x)
  # Spread over the split: the windows come from all four held-out works.
  _, val = corpora.split_shakespeare(4)
  rows = [shakespeare.tokenizer.decode(row) for x in a for row in x["inputs"]]
  assert {i for r in rows for i, t in enumerate(val.texts) if r in t} == {0, 1, 2, 3}
  long = shakespeare.eval_batches(batch_size=4, seq_len=256, num_batches=1)[0]
  assert long["inputs"].shape == (4, 256)
  halves = [make_source(_cfg(), None, process_index=p, process_count=2)
            .eval_batches(4, 64, 3) for p in range(2)]
  for i in range(3):
    np.testing.assert_array_equal(
        np.concatenate([halves[0][i]["targets"], halves[1][i]["targets"]]), a[i]["targets"])


def test_bin_corpus_is_memmapped_and_split_at_the_tail(tmp_path):
  rng = np.random.default_rng(0)
  parts = [rng.integers(0, 256, n).astype(np.uint32) for n in (700, 300)]
  for i, p in enumerate(parts):
    p.tofile(tmp_path / f"shard{i}.bin")
  src = make_source(_cfg(corpus=str(tmp_path / "*.bin"), token_dtype="uint32",
                         val_fraction=0.1), None)
  assert all(isinstance(p, np.memmap) for p in src.train.pieces)
  assert (len(src.train), len(src.val)) == (900, 100)
  whole = np.concatenate(parts)
  ev = src.eval_batches(batch_size=1, seq_len=99, num_batches=1)[0]
  np.testing.assert_array_equal(ev["inputs"][0], whole[900:999])
  np.testing.assert_array_equal(ev["targets"][0], whole[901:1000])
  # A window across the two files: the second file starts a new document.
  w = pack_window(src.train, 69, 10, 256)
  np.testing.assert_array_equal(w["inputs"], whole[690:700])
  np.testing.assert_array_equal(w["segment_ids"], [1] * 10)
  assert w["weights"][-1] == 0
  w = pack_window(src.train, 70, 10, 256)
  np.testing.assert_array_equal(w["inputs"], whole[700:710])
  # uint16 tokens read as bytes fail loudly when the corpus is opened (issue 28, item 6).
  np.array([1, 2, 300, 4] * 10, np.uint16).tofile(tmp_path / "wide.bin")
  with pytest.raises(ValueError, match="wide.bin holds token id 300 at position 2"):
    make_source(_cfg(corpus=str(tmp_path / "wide.bin")), None)


def test_text_corpus_split_by_file_with_sentencepiece(tmp_path):
  works = corpora.shakespeare_works()
  names = ["hamlet", "macbeth", "lear", "othello", "tempest"]
  for n in names:
    (tmp_path / f"{n}.txt").write_text(works[n][:3000], encoding="utf-8")
  cfg = _cfg(corpus=str(tmp_path), val_fraction=0.2, tokenizer="sentencepiece", vocab_size=400)
  wd = str(tmp_path / "run")
  src = make_source(cfg, wd)
  assert len(src.val.names) == 1 and src.val.names[0] not in src.train.names
  assert os.path.isfile(os.path.join(wd, SPM_FILE))
  eos = src.tokenizer.eos_id
  tokens = src.train.pieces[0]
  assert np.sum(tokens == eos) == 4  # One EOS closing each train document.
  again = make_source(cfg, wd)  # A resumed run: cached tokenizer, identical tokens.
  np.testing.assert_array_equal(again.train.pieces[0], tokens)
  batch = src.eval_batches(batch_size=2, seq_len=32, num_batches=2)[0]
  _check_packing(batch)
  text = works[names[0]][:3000]
  ids = src.tokenizer.encode(text)
  assert bits_per_byte(np.log(2) * 10, 10) == pytest.approx(1.0)
  one = {"targets": np.array([ids[:4]]), "weights": np.array([[1.0, 1.0, 0.0, 1.0]])}
  assert target_bytes(src.tokenizer.token_bytes, one) == sum(
      len(src.tokenizer.decode([i]).encode()) for i in np.array(ids[:4])[[0, 1, 3]])


def test_single_text_file_splits_at_a_line(tmp_path):
  lines = [f"line {i}\n" for i in range(100)]
  (tmp_path / "one.txt").write_text("".join(lines), encoding="utf-8")
  train, val = corpora.split_text_files([str(tmp_path / "one.txt")], 0.1)
  assert train.texts[0] + val.texts[0] == "".join(lines)
  assert val.texts[0].startswith("line ") and train.texts[0].endswith("\n")


def test_clear_errors(tmp_path):
  missing = str(tmp_path / "no_such_dir")
  with pytest.raises(FileNotFoundError, match="no_such_dir.*no such file"):
    make_source(_cfg(corpus=missing), None)
  with pytest.raises(FileNotFoundError, match=r"\*\.txt.*matches no files"):
    make_source(_cfg(corpus=str(tmp_path / "*.txt")), None)
  (tmp_path / "a.txt").write_text("hi\n")
  (tmp_path / "b.bin").write_bytes(b"\0\0")
  with pytest.raises(ValueError, match="all .txt"):
    make_source(_cfg(corpus=str(tmp_path / "*.*")), None)
  with pytest.raises(ValueError, match="data.token_dtype='int8'"):
    make_source(_cfg(corpus=str(tmp_path / "b.bin"), token_dtype="int8"), None)
  with pytest.raises(ValueError, match="data.num_val_works=0"):
    make_source(_cfg(num_val_works=0), None)
  with pytest.raises(ValueError, match="data.val_fraction=1.5"):
    make_source(_cfg(corpus=str(tmp_path / "a.txt"), val_fraction=1.5), None)
  (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
  with pytest.raises(ValueError, match="latin1.txt is not UTF-8"):
    make_source(_cfg(corpus=str(tmp_path / "latin1.txt")), None)

"""Tokenizers: exact round trips, token_bytes accounting, SentencePiece caching."""

import logging
import os

import numpy as np
import pytest

from experiments.configs.base import get_config
from train.data import corpora, tokenizers
from train.data.tokenizers import SPM_FILE, ByteTokenizer, SentencePieceTokenizer, load_tokenizer

# Unseen characters exercise byte fallback; blank lines and runs of spaces
# exercise the whitespace settings.
ODD_TEXT = "Naïve café — 漢字 🙂\n\n  two  spaces,\ttab\nROMEO:\nWherefore art thou?\n"
SP_VOCAB = 400


@pytest.fixture(scope="module")
def train_texts():
  works = corpora.shakespeare_works()
  return [works["hamlet"][:4000], works["macbeth"][:4000]]


@pytest.fixture(scope="module")
def sp(train_texts):
  return SentencePieceTokenizer.train(train_texts, SP_VOCAB)


def _cfg(**kw):
  c = get_config().data
  c.update(kw)
  return c


def test_byte_round_trip_and_ids():
  tok = ByteTokenizer()
  ids = tok.encode(ODD_TEXT)
  assert ids == list(ODD_TEXT.encode("utf-8"))
  assert tok.decode(ids) == ODD_TEXT
  assert tok.decode(np.array(ids + [300, -1])) == ODD_TEXT  # Padded-vocab ids are dropped.
  assert tok.vocab_size == 256 and tok.eos_id is None


@pytest.mark.parametrize("name", ["byte", "sp"])
def test_token_bytes_sum_to_utf8_length(name, sp):
  tok = ByteTokenizer() if name == "byte" else sp
  for text in (ODD_TEXT, corpora.shakespeare_works()["sonnets"][:3000]):
    ids = tok.encode(text)
    assert tok.token_bytes.shape == (tok.vocab_size,)
    assert int(tok.token_bytes[ids].sum()) == len(text.encode("utf-8"))


def test_sentencepiece_round_trip_compresses_and_has_eos(sp):
  held_out = corpora.shakespeare_works()["sonnets"][:3000]
  for text in (ODD_TEXT, held_out):
    assert sp.decode(sp.encode(text)) == text
  assert sp.vocab_size == SP_VOCAB
  assert len(sp.encode(held_out)) < 0.7 * len(held_out.encode())  # Merges were learned.
  assert sp.eos_id is not None and sp.token_bytes[sp.eos_id] == 0
  assert sp.eos_id not in sp.encode(held_out + "</s>")  # EOS never comes from text.


def test_sentencepiece_training_is_deterministic(sp, train_texts):
  assert SentencePieceTokenizer.train(train_texts, SP_VOCAB).model_proto == sp.model_proto


def test_load_tokenizer_caches_in_workdir(tmp_path, train_texts):
  cfg = _cfg(tokenizer="sentencepiece", vocab_size=SP_VOCAB)
  first = load_tokenizer(cfg, str(tmp_path), train_texts=train_texts)
  assert os.path.isfile(tmp_path / SPM_FILE)
  # A resumed run loads the cache: no texts needed, and other texts can't retrain it.
  again = load_tokenizer(cfg, str(tmp_path), train_texts=["something else entirely"])
  assert again.model_proto == first.model_proto
  # data.spm_model supplies a model to a new workdir, which then caches it.
  given = load_tokenizer(_cfg(tokenizer="sentencepiece", vocab_size=SP_VOCAB,
                              spm_model=str(tmp_path / SPM_FILE)), str(tmp_path / "b"))
  assert given.model_proto == first.model_proto
  assert os.path.isfile(tmp_path / "b" / SPM_FILE)
  with pytest.raises(ValueError, match="data.vocab_size=512"):
    load_tokenizer(_cfg(tokenizer="sentencepiece", vocab_size=512), str(tmp_path))


def test_load_tokenizer_errors(tmp_path):
  assert isinstance(load_tokenizer(_cfg(), None), ByteTokenizer)
  with pytest.raises(ValueError, match="data.tokenizer='wordpiece'"):
    load_tokenizer(_cfg(tokenizer="wordpiece"), None)
  with pytest.raises(ValueError, match="needs a model"):
    load_tokenizer(_cfg(tokenizer="sentencepiece", vocab_size=SP_VOCAB), str(tmp_path))
  with pytest.raises(ValueError, match="data.vocab_size=100"):
    load_tokenizer(_cfg(tokenizer="sentencepiece", vocab_size=100), None,
                   train_texts=["some text\n"] * 10)
  with pytest.raises(FileNotFoundError, match="nope.model"):
    load_tokenizer(_cfg(tokenizer="sentencepiece", spm_model=str(tmp_path / "nope.model")), None)


def test_sentencepiece_training_logs_only_when_slow(train_texts, monkeypatch, caplog):
  """A long training (here: any, with the threshold at 0 s) says so and when it ends;
  a quick one stays silent."""
  caplog.set_level(logging.INFO, logger=tokenizers.__name__)
  SentencePieceTokenizer.train(train_texts, SP_VOCAB)
  assert not caplog.records
  monkeypatch.setattr(tokenizers, "SLOW_TRAINING_S", 0.0)
  SentencePieceTokenizer.train(train_texts, SP_VOCAB)
  messages = [r.getMessage() for r in caplog.records]
  assert any("SentencePiece" in m and "still running" in m for m in messages), messages
  assert "done in" in messages[-1] and "lines" in messages[-1], messages


def test_fingerprint_tells_tokenizers_apart_and_is_stable(sp, train_texts):
  from train.data.mqar import MQARTokenizer  # pylint: disable=g-import-not-at-top
  again = SentencePieceTokenizer(sp.model_proto)
  other = SentencePieceTokenizer.train(train_texts, SP_VOCAB + 8)
  prints = {tokenizers.fingerprint(t) for t in
            (ByteTokenizer(), sp, other, MQARTokenizer(256), MQARTokenizer(64))}
  assert len(prints) == 5, prints
  assert tokenizers.fingerprint(again) == tokenizers.fingerprint(sp)
  assert tokenizers.fingerprint(sp).startswith("sentencepiece-")

"""One SentencePiece tokenizer for a mixture (issue 46 item 5): `--mode prepare
--tokenizer_from=NAME=INPUT:WEIGHT,...` trains it on every dataset of the mixture, each
sampled by its weight, so no domain is left with byte-fallback tokens; the other
datasets' prepares reuse it (data.spm_model)."""

import json

import pytest

from tests.cli import launch
from train.data.formats import PrepareError
from train.data.prepare import prepare

WORDS = ("version", "release", "fixed", "upstream", "package", "changes", "urgency",
         "medium", "closes", "maintainer", "debian", "build", "depends", "security")


def _corpora(root):
  """Changelog-like English and locale-like <Uxxxx> code points: unlike alphabets."""
  (root / "log").mkdir()
  for i in range(30):
    (root / "log" / f"c{i}.txt").write_text(" ".join(
        WORDS[(i * 5 + j * j) % len(WORDS)] for j in range(120)) + "\n")
  (root / "loc").mkdir()
  for i in range(30):
    (root / "loc" / f"l{i}.txt").write_text(";".join(
        f"<U{(0x41 + (i * 3 + j * 7) % 90):04X}>" for j in range(200)) + "\n")


def _bytes_per_token(out):
  split = json.loads((out / "manifest.json").read_text())["splits"]["train"]
  return split["bytes"] / split["tokens"]


def test_a_tokenizer_trained_on_the_mixture_is_fair_to_the_second_domain(tmp_path):
  _corpora(tmp_path)
  spm = ["--config.data.tokenizer=sentencepiece", "--config.data.vocab_size=320",
         "--config.data.val_fraction=0.3", "--prepare_workers=0"]
  # Today's recipe: trained on the first corpus, reused for the second.
  launch("--mode", "prepare", "--input", str(tmp_path / "log"), "--output",
         str(tmp_path / "log1"), *spm)
  launch("--mode", "prepare", "--input", str(tmp_path / "loc"), "--output",
         str(tmp_path / "loc1"), *spm,
         f"--config.data.spm_model={tmp_path}/log1/tokenizer/spm.model")
  # One tokenizer over both, sampled 60/40.
  launch("--mode", "prepare", "--input", str(tmp_path / "log"), "--output",
         str(tmp_path / "log2"), *spm,
         f"--tokenizer_from=log={tmp_path}/log:0.6,loc={tmp_path}/loc:0.4")
  launch("--mode", "prepare", "--input", str(tmp_path / "loc"), "--output",
         str(tmp_path / "loc2"), *spm,
         f"--config.data.spm_model={tmp_path}/log2/tokenizer/spm.model")
  skewed, fair = _bytes_per_token(tmp_path / "loc1"), _bytes_per_token(tmp_path / "loc2")
  assert fair > 1.5 * skewed, (skewed, fair)
  manifest = json.loads((tmp_path / "log2" / "manifest.json").read_text())
  assert manifest["options"]["tokenizer_from"] == [["log", f"{tmp_path}/log", 0.6],
                                                   ["loc", f"{tmp_path}/loc", 0.4]]


def test_bad_tokenizer_from_is_refused_by_name(tmp_path):
  _corpora(tmp_path)
  with pytest.raises(PrepareError, match="needs tokenizer='sentencepiece'"):
    prepare([str(tmp_path / "log")], str(tmp_path / "o"), tokenizer="byte", workers=0,
            progress=False, tokenizer_from=f"a={tmp_path}/log")
  with pytest.raises(PrepareError, match="expected NAME=INPUT"):
    prepare([str(tmp_path / "log")], str(tmp_path / "o"), tokenizer="sentencepiece",
            workers=0, progress=False, tokenizer_from=f"{tmp_path}/log:0.5")

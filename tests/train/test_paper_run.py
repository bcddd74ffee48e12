"""What a researcher trips over (issue 28), through launch.py: one SentencePiece run on a
corpus of their own, trained once (module fixture), and the refusals and records around it."""

import json
import os
import random
import shutil

import pytest

from tests.cli import launch
from train.lifecycle.lock import LOCK_FILE, LockError

WORDS = ("alpha", "beta", "gamma", "delta", "ember", "frost", "grove", "harbor", "isle", "jade",
         "kelp", "lumen", "moss", "north", "opal", "pine", "quill", "reef", "stone", "tide")


def write_corpus(root, files=6, lines=60, seed=0):
  """`files` text files, and one in Latin-1 (not UTF-8), as a real corpus may hold."""
  rng = random.Random(seed)
  os.makedirs(root, exist_ok=True)
  for i in range(files):
    with open(os.path.join(root, f"doc{i}.txt"), "w") as f:
      f.writelines(" ".join(rng.choice(WORDS) for _ in range(12)) + ".\n" for _ in range(lines))
  with open(os.path.join(root, "latin1.txt"), "wb") as f:
    f.write("caf\u00e9 cr\u00e8me\n".encode("latin-1") * 20)
  return str(root)


def spm_flags(corpus, skip=True):
  # No model.vocab_size: the model takes the tokenizer's (item 8).
  return ("--config.data.tokenizer=sentencepiece", "--config.data.vocab_size=300",
          f"--config.data.corpus={corpus}", "--config.data.val_fraction=0.2",
          f"--config.data.skip_undecodable={skip}")


# The default warmup (50 steps here) is longer than the 4-step run (item 9).
RUN_FLAGS = ("--config.train.async_checkpoint=False", "--config.train.tensorboard=False",
             "--config.train.log_every=2", "--config.train.eval_every=4",
             "--config.train.checkpoint_every=2", "--config.train.warmup_steps=50",
             "--config.hardware.peak_flops=1000.0",  # Far below what the run achieves.
             "--config.eval.at_start=True")  # Eval curves from step 0 (item 12).


@pytest.fixture(scope="module")
def paper(tmp_path_factory):
  """A finished 4-step SentencePiece run with checkpoints at 2 and 4."""
  root = tmp_path_factory.mktemp("paper")
  corpus = write_corpus(root / "corpus")
  workdir = root / "run"
  out = launch("--workdir", str(workdir), *spm_flags(corpus), *RUN_FLAGS,
               "--config.train.steps=4")
  return corpus, workdir, out


@pytest.fixture
def copy(paper, tmp_path):
  dst = tmp_path / "run"
  shutil.copytree(paper[1], dst)
  return dst


def _record(workdir):
  with open(os.path.join(workdir, "config.json")) as f:
    return json.load(f)


def test_the_model_takes_the_tokenizers_vocabulary_and_a_short_run_warms_up_within_it(paper):
  _, workdir, out = paper
  assert _record(workdir)["model"]["vocab_size"] == 300  # Recorded resolved (items 8, 9).
  assert "tensorboard" not in out.splitlines()[-1]  # Item 7: train.tensorboard=False.
  assert not os.path.exists(os.path.join(workdir, "tensorboard"))


def test_eval_at_start_logs_the_untrained_model_at_step_0(paper):
  with open(paper[1] / "metrics.jsonl") as f:
    evals = [r for r in map(json.loads, f) if r["split"] == "eval"]
  assert [r["step"] for r in evals] == [0, 4]
  assert evals[0]["loss"] > evals[1]["loss"]


def test_mfu_never_exceeds_one_even_against_a_peak_the_run_outpaces(paper):
  with open(paper[1] / "metrics.jsonl") as f:
    mfu = [r["mfu"] for r in map(json.loads, f) if r["split"] == "train"]
  assert mfu and all(0 < m <= 1.0 for m in mfu), mfu


def test_a_conflicting_explicit_model_vocabulary_is_refused_by_name(paper, tmp_path):
  with pytest.raises(ValueError, match=r"model\.vocab_size=256.*data\.vocab_size=300"):
    launch("--workdir", str(tmp_path / "x"), *spm_flags(paper[0]), "--config.model.vocab_size=256")
  assert not os.path.exists(tmp_path / "x")


def test_config_json_records_what_the_model_was_trained_on(paper):
  corpus, workdir, _ = paper
  data = _record(workdir)["_run"]["data"]
  assert data["corpus"] == corpus and data["files"] == 7
  assert data["skipped_documents"] == [os.path.join(corpus, "latin1.txt")]  # Item 6.
  assert data["train_documents"] == 5 and len(data["val_documents"]) == 1
  assert data["train_tokens"] > 1000 and 0 < data["val_tokens"] < data["train_tokens"]
  assert data["vocab_size"] == 300 and data["tokenizer_fingerprint"].startswith("sentencepiece-")


def test_resume_without_the_runs_tokenizer_is_refused_before_training_another(paper, copy):
  corpus = paper[0]
  os.remove(copy / "tokenizer" / "spm.model")
  edited = os.path.join(corpus, "doc0.txt")
  original = open(edited).read()
  try:
    with open(edited, "a") as f:
      f.write("zebra xylophone yonder\n" * 50)
    before = sorted(os.listdir(copy))
    with pytest.raises(ValueError, match=r"spm\.model, the SentencePiece model this run was "
                                         r"trained with \(its fingerprint in config\.json"):
      launch("--workdir", str(copy), *spm_flags(corpus), *RUN_FLAGS, "--config.train.steps=6")
  finally:
    with open(edited, "w") as f:
      f.write(original)
  assert sorted(os.listdir(copy)) == before  # No config_changes.jsonl, nothing rewritten.
  assert not os.path.exists(copy / "tokenizer" / "spm.model")


def test_resume_with_another_tokenizer_is_refused(paper, copy, tmp_path):
  other = write_corpus(tmp_path / "other", seed=1)
  from train.data.tokenizers import SentencePieceTokenizer
  texts = [open(os.path.join(other, f"doc{i}.txt")).read() for i in range(6)]
  SentencePieceTokenizer.train(texts, 300).save(str(copy / "tokenizer" / "spm.model"))
  with pytest.raises(ValueError, match="not the tokenizer the run .* was trained with"):
    launch("--workdir", str(copy), *spm_flags(paper[0]), *RUN_FLAGS, "--config.train.steps=6")


def test_generate_without_the_runs_tokenizer_names_the_missing_file(copy):
  os.remove(copy / "tokenizer" / "spm.model")
  with pytest.raises(ValueError, match=r"tokenizer/spm\.model, the SentencePiece model this "
                                       "run was trained with.*is missing"):
    launch("--mode", "generate", "--workdir", str(copy), "--prompt", "alpha")


def test_a_corpus_without_text_is_refused_naming_data_corpus_before_anything_is_written(
    tmp_path):
  corpus = tmp_path / "empty"
  corpus.mkdir()
  for i in range(3):
    (corpus / f"e{i}.txt").write_text("")
  workdir = tmp_path / "run"
  with pytest.raises(ValueError, match=r"config\.data\.corpus=.*empty.*the train split has 0 "
                                       "tokens"):
    launch("--workdir", str(workdir), f"--config.data.corpus={corpus}")
  assert not workdir.exists()  # Item 7: a failed launch leaves no empty directory.
  (corpus / "one.txt").write_text("abcd")  # A single 4-byte file: validation gets 0.
  with pytest.raises(ValueError, match=r"config\.data\.corpus=.*split has \d+ tokens"):
    launch("--workdir", str(workdir), f"--config.data.corpus={corpus / 'one.txt'}")
  assert not workdir.exists()


def test_a_non_utf8_file_is_refused_by_name_unless_skipped(paper, tmp_path):
  with pytest.raises(ValueError, match=r"latin1\.txt is not UTF-8 text .* set "
                                       r"data\.skip_undecodable=True"):
    launch("--workdir", str(tmp_path / "x"), *spm_flags(paper[0], skip=False))
  assert not (tmp_path / "x").exists()


def test_out_of_vocabulary_ids_in_a_bin_corpus_are_found_when_it_is_opened(tmp_path):
  import numpy as np  # pylint: disable=g-import-not-at-top
  ids = np.arange(5000, dtype=np.uint16) % 256
  ids[4321] = 300  # Byte tokenizer: 256 ids.
  ids.tofile(tmp_path / "tokens.bin")
  with pytest.raises(ValueError, match=r"tokens\.bin holds token id 300 at position 4321, "
                                       "outside the vocabulary"):
    launch("--workdir", str(tmp_path / "x"), f"--config.data.corpus={tmp_path / 'tokens.bin'}")
  assert not (tmp_path / "x").exists()


def test_generate_with_a_garbage_spm_model_names_the_file(copy):
  (copy / "tokenizer" / "spm.model").write_bytes(b"not a sentencepiece model")
  with pytest.raises(ValueError, match=r"spm\.model is not a SentencePiece model"):
    launch("--mode", "generate", "--workdir", str(copy), "--prompt", "alpha")


def test_a_garbage_lock_is_reported_as_such(tmp_path):
  tmp_path.joinpath(LOCK_FILE).write_bytes(b"\x00garbage\xff")
  with pytest.raises(LockError, match=r"LOCK exists but is not a lock record \(it holds "
                                      r"b'\\x00garbage"):
    launch("--workdir", str(tmp_path))


def _flip_bytes(workdir, step, n=64):
  """Flips `n` bytes in the middle of the largest file of checkpoint `step`."""
  files = [os.path.join(here, f) for here, _, names in os.walk(workdir / "checkpoints" / str(step))
           for f in names]
  largest = max(files, key=os.path.getsize)
  with open(largest, "r+b") as f:
    f.seek(os.path.getsize(largest) // 2)
    data = f.read(n)
    f.seek(os.path.getsize(largest) // 2)
    f.write(bytes(b ^ 0xFF for b in data))


def test_a_damaged_checkpoint_is_detected_and_readers_fall_back_with_a_warning(copy, caplog):
  from train.io.checksums import CheckpointDamaged
  assert os.path.exists(copy / "checkpoints" / "4" / "CHECKSUMS.json")
  _flip_bytes(copy, 4)
  with pytest.raises(CheckpointDamaged, match=r"checkpoints/4 is damaged: .* differs from the "
                                              "checksum written when it was saved"):
    launch("--mode", "eval", "--workdir", str(copy), "--step", "4")
  out = launch("--mode", "eval", "--workdir", str(copy))
  assert out.startswith(f"{copy} step 2")
  assert any("step 4 failed to restore (CheckpointDamaged" in r.getMessage()
             for r in caplog.records)
  assert os.path.isdir(copy / "checkpoints" / "4")  # A reader moves nothing.


def test_resume_from_a_damaged_checkpoint_moves_it_aside_and_continues_the_previous(
    paper, copy, caplog):
  _flip_bytes(copy, 4)
  launch("--workdir", str(copy), *spm_flags(paper[0]), *RUN_FLAGS, "--config.train.steps=4")
  assert os.path.isdir(copy / "checkpoints_corrupt" / "4")
  assert any("moving it to checkpoints_corrupt" in r.getMessage() for r in caplog.records)
  with open(copy / "metrics.jsonl") as f:
    assert [json.loads(l)["step"] for l in f][-1] == 4  # Steps 3-4 trained again.


def test_export_of_a_sentencepiece_run_writes_what_autotokenizer_loads(paper, tmp_path):
  transformers = pytest.importorskip("transformers")
  from train.data.tokenizers import SentencePieceTokenizer
  out = tmp_path / "hf"
  launch("--mode", "export", "--workdir", str(paper[1]), "--hf_dir", str(out))
  assert {"tokenizer.model", "tokenizer_config.json"} <= set(os.listdir(out))
  ours = SentencePieceTokenizer.load(str(paper[1] / "tokenizer" / "spm.model"))
  theirs = transformers.AutoTokenizer.from_pretrained(str(out))
  for text in ("alpha beta\ngamma  delta.", " leading space", "caf\u00e9 \U0001f600\ttab\n\n", "x"):
    ids = ours.encode(text)
    assert theirs.encode(text, add_special_tokens=False) == ids, text
    assert theirs.decode(ids) == text

"""A Hugging Face dir with a tokenizer.json imports as a run that generates text, and the
export writes the tokenizer back. The model dir is written by export_hf_dir from random
weights and the tokenizer.json is trained here (no torch, no network)."""

import json
import os

import pytest

pytest.importorskip("tokenizers")  # The `interop` extra (through transformers).

from interop import export_hf_dir  # noqa: E402
from model import ModelConfig  # noqa: E402
from tests.cli import launch  # noqa: E402
from tests.interop.test_hf_weights import init  # noqa: E402
from tests.train.data.test_hf_tokenizer import train_tokenizer_json  # noqa: E402

CFG = ModelConfig(vocab_size=320, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  mlp_dim=48, max_seq_len=32)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  params, state = init(CFG)
  d = str(tmp_path_factory.mktemp("hf") / "tiny")
  export_hf_dir((CFG, {"params": params, **state}), d)
  train_tokenizer_json(os.path.join(d, "tokenizer.json"))
  with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
    json.dump({"eos_token": "<|end|>", "model_max_length": 32}, f)
  return d


@pytest.fixture(scope="module")
def run_dir(hf_dir, tmp_path_factory):
  run = str(tmp_path_factory.mktemp("run") / "run")
  assert "imported" in launch("--mode", "import", "--hf_dir", hf_dir, "--workdir", run)
  return run


@pytest.fixture(scope="module")
def greedy(run_dir):
  """`--mode generate` of the imported run: 6 greedy tokens after "hello"."""
  return launch("--mode", "generate", "--workdir", run_dir, "--prompt", "hello",
                "--max_new_tokens", "6", "--temperature", "0").splitlines()[0]


def test_import_copies_tokenizer_json_and_generate_prints_text(run_dir, greedy):
  from train.generate import generate  # pylint: disable=g-import-not-at-top
  from train import load_run  # pylint: disable=g-import-not-at-top
  from train.data.tokenizers import HFTokenizer  # pylint: disable=g-import-not-at-top
  run = load_run(run_dir)
  assert (run.config.data.tokenizer, run.config.data.vocab_size) == ("hf", 300)
  tok = run.tokenizer
  assert isinstance(tok, HFTokenizer) and tok.eos_id == 0
  ids = tok.encode("hello")
  assert len(ids) < len("hello")  # BPE pieces, not the byte tokenizer's bytes.
  (new_ids,) = generate(run.model_config, run.variables, [ids], 6, temperature=0.0,
                               eos_id=0)
  assert greedy == tok.decode(ids + list(new_ids)) and greedy.startswith("hello")


def test_export_writes_the_tokenizer_back(run_dir, hf_dir, greedy, tmp_path):
  import tokenizers  # pylint: disable=g-import-not-at-top
  out = str(tmp_path / "out")
  assert "exported" in launch("--mode", "export", "--workdir", run_dir, "--hf_dir", out)
  back = tokenizers.Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
  orig = tokenizers.Tokenizer.from_file(os.path.join(hf_dir, "tokenizer.json"))
  assert back.encode("hello world").ids == orig.encode("hello world").ids
  with open(os.path.join(out, "tokenizer_config.json")) as f:
    assert json.load(f)["eos_token"] == "<|end|>"
  with open(os.path.join(out, "config.json")) as f:
    hf = json.load(f)
  assert hf["vocab_size"] == 320 and hf["eos_token_id"] == 0  # The run tokenizer's end id.
  with open(os.path.join(out, "generation_config.json")) as f:
    assert json.load(f) == {"eos_token_id": 0}  # This tokenizer has no start token.
  # transformers reads the export as it is: its tokenizer and a pipeline that
  # generates, greedily, the text blockwork generates.
  pytest.importorskip("torch")
  from transformers import AutoTokenizer, pipeline  # pylint: disable=g-import-not-at-top
  tok = AutoTokenizer.from_pretrained(out)
  assert tok("hello world").input_ids == orig.encode("hello world").ids
  assert (tok.eos_token, tok.eos_token_id) == ("<|end|>", 0)
  generate = pipeline("text-generation", model=out, tokenizer=tok, device="cpu")
  assert generate("hello", max_new_tokens=6, do_sample=False)[0]["generated_text"] == greedy
  # An export never lands on files already there (here: the run directory itself).
  before = {n: open(os.path.join(run_dir, n), "rb").read() for n in ("config.json",)}
  with pytest.raises(Exception, match="not empty"):
    launch("--mode", "export", "--workdir", run_dir, "--hf_dir", run_dir)
  assert before == {n: open(os.path.join(run_dir, n), "rb").read() for n in before}

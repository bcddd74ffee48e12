"""HFTokenizer: a Hugging Face tokenizer.json through the `tokenizers` library.

The tokenizer.json is a tiny byte-level BPE trained here (no network, no files shipped).
"""

import json
import os

import ml_collections
import pytest

pytest.importorskip("tokenizers")  # The `interop` extra (through transformers).

from experiments.configs import base  # noqa: E402
from train.data import tokenizers as toks  # noqa: E402
from train.spec import parse  # noqa: E402

SENTENCES = ["hello world, hello there", "the quick brown fox jumps over the lazy dog",
             "Where the bee sucks, there suck I", "héllo wörld — naïve café 日本語"]


def train_tokenizer_json(path: str, vocab_size: int = 300) -> str:
  """A byte-level BPE tokenizer.json with one special token "<|end|>" (id 0)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|end|>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(SENTENCES * 4, trainer)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tok.save(path)
  return path


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
  return train_tokenizer_json(str(tmp_path_factory.mktemp("tok") / "tokenizer.json"))


@pytest.mark.parametrize("text", SENTENCES + ["unseen text\nwith a newline 🙂", ""])
def test_round_trip_and_token_bytes_sum_to_utf8_length(tok_path, text):
  tok = toks.HFTokenizer.load(tok_path)
  ids = tok.encode(text)
  assert tok.decode(ids) == text
  assert int(tok.token_bytes[ids].sum()) == len(text.encode("utf-8"))
  assert [list(x) for x in toks.encode_many(tok, [text, "hello"])] == [ids, tok.encode("hello")]


def test_special_tokens_count_zero_bytes_and_decode_to_nothing(tok_path):
  tok = toks.HFTokenizer.load(tok_path)
  assert tok.token_bytes[0] == 0 and (tok.token_bytes[1:] > 0).all()
  assert tok.decode([0] + tok.encode("hi") + [0, 10**6]) == "hi"  # Out of vocab: dropped.


def test_end_token_from_tokenizer_config_else_config_json(tmp_path, tok_path):
  assert toks.HFTokenizer.load(tok_path).eos_id is None
  d = tmp_path / "d"
  path = train_tokenizer_json(str(d / "tokenizer.json"))
  (d / "config.json").write_text(json.dumps({"eos_token_id": [5, 6], "bos_token_id": 7}))
  tok = toks.HFTokenizer.load(path)
  assert (tok.eos_id, tok.bos_id) == (5, 7)
  (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|end|>"}}))
  tok = toks.HFTokenizer.load(path)
  assert tok.eos_id == 0
  tok.save(str(tmp_path / "copy"))  # The copy resolves the same ids without the model dir.
  again = toks.HFTokenizer.load(str(tmp_path / "copy" / "tokenizer.json"))
  assert (again.eos_id, again.bos_id, again.vocab_size) == (0, 7, tok.vocab_size)


def data_cfg(tokenizer, vocab_size):
  return ml_collections.ConfigDict({"tokenizer": tokenizer, "vocab_size": vocab_size})


def test_hf_path_is_copied_into_the_run_and_hf_reads_the_copy(tmp_path, tok_path):
  vocab = toks.HFTokenizer.load(tok_path).vocab_size
  run = str(tmp_path / "run")
  tok = toks.load_tokenizer(data_cfg(f"hf:{tok_path}", vocab), run)
  assert os.path.isfile(os.path.join(run, "tokenizer", "tokenizer.json"))
  again = toks.load_tokenizer(data_cfg("hf", vocab), run, cache=False)
  assert again.encode("hello there") == tok.encode("hello there")
  with pytest.raises(ValueError, match=f"data.vocab_size=999 but .* has {vocab} tokens"):
    toks.load_tokenizer(data_cfg("hf", 999), run)
  with pytest.raises(FileNotFoundError, match="data.tokenizer='hf' .*does not exist"):
    toks.load_tokenizer(data_cfg("hf", vocab), str(tmp_path / "empty"))


def test_validation_accepts_hf_paths_and_names_the_field_on_a_missing_file(tok_path):
  c = base.get_config("smoke")
  vocab = toks.HFTokenizer.load(tok_path).vocab_size
  c.data.tokenizer, c.data.vocab_size, c.model.vocab_size = f"hf:{tok_path}", vocab, 320
  parse(c, 1)
  c.data.tokenizer = "hf:/no/such/tokenizer.json"
  with pytest.raises(ValueError, match=r"config.data.tokenizer='hf:/no/such/tokenizer.json': "
                     r"no such file '/no/such/tokenizer.json'"):
    parse(c, 1)
  c.data.tokenizer = "gpt2"
  with pytest.raises(ValueError, match=r"config.data.tokenizer='gpt2': must be one of .*hf:PATH"):
    parse(c, 1)

"""The byte tokenizer (train/data/tokenizers.py ByteTokenizer) as a Hugging Face
`tokenizer.json`, so an exported byte-level run loads in transformers (and the
lm-evaluation-harness's `hf` backend) with the ids it was trained on: token b is
byte b.

It is a byte-level BPE with no merges: the ByteLevel pre-tokenizer maps each UTF-8
byte to one printable character (GPT-2's table), the vocabulary maps that character
to the byte's value, and the ByteLevel decoder maps back. No special tokens (the
byte tokenizer has none).
"""

from __future__ import annotations

import json
import os

FILES = ("tokenizer.json", "tokenizer_config.json")


def tokenizer_json() -> str:
  """The tokenizer.json text."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  from tokenizers import decoders, models, pre_tokenizers  # pylint: disable=g-import-not-at-top
  table = _bytes_to_unicode()
  tok = tokenizers.Tokenizer(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = decoders.ByteLevel()
  return tok.to_str()


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> character table, which the ByteLevel pre-tokenizer applies."""
  from tokenizers import pre_tokenizers  # pylint: disable=g-import-not-at-top
  alphabet = pre_tokenizers.ByteLevel.alphabet()
  printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
               + list(range(ord("®"), ord("ÿ") + 1)))
  out, extra = {}, 0
  for b in range(256):
    if b in printable:
      out[b] = chr(b)
    else:
      out[b] = chr(256 + extra)
      extra += 1
  if set(out.values()) != set(alphabet):
    raise RuntimeError("tokenizers' ByteLevel alphabet is not GPT-2's byte table")
  return out


def write_files(out_dir: str, max_len: int | None = None) -> list[str]:
  """tokenizer.json + tokenizer_config.json in `out_dir`; their names."""
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
            "add_bos_token": False, "add_eos_token": False}
  if max_len:
    config["model_max_length"] = int(max_len)
  os.makedirs(out_dir, exist_ok=True)
  for name, text in zip(FILES, (tokenizer_json(), json.dumps(config, indent=2))):
    with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
      f.write(text)
  return list(FILES)

"""The tokenizer a prepare uses, saved into the dataset's tokenizer/ directory.

SentencePiece is trained on a bounded, deterministic sample: train-split documents
from the start of each source, an equal share of `sample_bytes` per source (so
every source is represented and the sample does not grow with the corpus).

`tokenizer_from` ("code=corpora/stdlib:0.7,docs=corpora/docs.jsonl:0.3") trains it on
a mixture's datasets instead, each sampled by its weight (`sample_bytes` x weight,
an equal share per file within it): one tokenizer fair to every domain, which each
dataset's prepare then reuses (data.spm_model=FIRST/tokenizer/spm.model).
"""

from __future__ import annotations

import os

from train.data import prepare_work
from train.data.formats import InputFile, PrepareError, Reader, find_sources
from train.data.tokenizers import (SPM_FILE, ByteTokenizer, HFTokenizer,
                                   SentencePieceTokenizer, Tokenizer)

TOKENIZER_DIR = "tokenizer"


def plan_tokenizer(options: dict, partial: str, sources: list[InputFile],
                   settings: dict) -> Tokenizer:
  """The prepare's tokenizer, saved in `partial/tokenizer/` (a resumed prepare
  reuses what it saved there, so its shards all mean the same ids)."""
  kind = options["tokenizer"]
  directory = os.path.join(partial, TOKENIZER_DIR)
  spm_path = os.path.join(partial, SPM_FILE)
  if kind == "byte":
    return ByteTokenizer()
  if kind.startswith("hf:"):
    saved = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(saved) and not os.path.isfile(kind[3:]):
      raise PrepareError(f"tokenizer {kind!r}: no such file {kind[3:]!r}")
    tok = HFTokenizer.load(saved if os.path.isfile(saved) else kind[3:])
    tok.save(directory)
    return tok
  if kind != "sentencepiece":
    raise PrepareError(f"tokenizer={kind!r}: must be 'byte', 'sentencepiece' or 'hf:PATH' "
                       "(a Hugging Face tokenizer.json)")
  if os.path.isfile(spm_path):
    tok = SentencePieceTokenizer.load(spm_path)
  elif options["spm_model"]:
    tok = SentencePieceTokenizer.load(options["spm_model"])
  elif options.get("tokenizer_from"):
    tok = SentencePieceTokenizer.train(
        mixture_texts(options["tokenizer_from"], int(options["sample_bytes"]), settings),
        int(options["vocab_size"]))
  else:
    tok = SentencePieceTokenizer.train(
        sample_texts(sources, int(options["sample_bytes"]), settings),
        int(options["vocab_size"]))
  if tok.vocab_size != int(options["vocab_size"]):
    raise PrepareError(f"vocab_size={options['vocab_size']} but the SentencePiece model has "
                       f"{tok.vocab_size} pieces")
  tok.save(spm_path)
  return tok


def parse_tokenizer_from(text: str) -> list[list]:
  """"code=corpora/stdlib:0.7,docs=corpora/docs.jsonl:0.3" -> [[name, spec, weight]]
  (weights normalised; a spec without ":WEIGHT" weighs 1)."""
  out = []
  for item in (i.strip() for i in text.split(",") if i.strip()):
    name, eq, spec = item.partition("=")
    head, colon, tail = spec.rpartition(":")
    try:
      weight = float(tail) if colon else 1.0
      spec = head if colon else spec
    except ValueError:
      weight = 1.0
    if not eq or not name.strip() or not spec.strip() or not weight > 0:
      raise PrepareError(f"--tokenizer_from: {item!r}: expected NAME=INPUT[:WEIGHT] with a "
                         "positive weight, e.g. code=corpora/stdlib:0.7,docs=docs.jsonl:0.3")
    out.append([name.strip(), spec.strip(), weight])
  if len({n for n, _, _ in out}) != len(out):
    raise PrepareError(f"--tokenizer_from={text!r}: a dataset is named twice")
  total = sum(w for _, _, w in out)
  return [[n, s, w / total] for n, s, w in out]


def mixture_texts(datasets: list[list], sample_bytes: int, settings: dict):
  """Each dataset's sample_texts, sample_bytes x its weight of them, in the given order."""
  for _, spec, weight in datasets:
    yield from sample_texts(find_sources([spec]), max(1, int(sample_bytes * weight)), settings)


def sample_texts(sources: list[InputFile], sample_bytes: int, settings: dict):
  """Train-split texts, up to sample_bytes / len(sources) UTF-8 bytes from the start
  of each source, in source order: the same sample on every run."""
  s = prepare_work.Settings(**settings, tokenizer=("byte",), dtype="uint16")
  share = max(1, int(sample_bytes) // len(sources))
  for i, src in enumerate(sources):
    taken = 0
    for chunk in Reader(src, i, s.text_field, s.id_field):
      docs, _ = prepare_work.documents(chunk, s)
      for ident, text in docs:
        if prepare_work.is_validation(ident, s.val_fraction):
          continue
        text = text[:share - taken] if taken + len(text) > share else text
        taken += len(text.encode("utf-8"))
        yield text
        if taken >= share:
          break
      if taken >= share:
        break


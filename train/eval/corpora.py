"""Named evaluation corpora, each evaluated apart at every eval: `loss/<name>`, `bpb/<name>`.

    --config.eval.corpora=docs=prepared/docs,stdlib=lib/**/*.txt

A prepared dataset contributes its validation split (it must have been tokenized
with the run's tokenizer: both fingerprints are named otherwise); .txt files are
read whole and tokenized with the run's tokenizer. A mixture's domains
(data.corpus="mixture") are always evaluated so, each on its own validation split,
under its name. Each corpus gets eval.batches fixed batches at the training length,
chosen as the headline eval chooses them (train/data/token_source.py), so
`bpb/code` is what evaluating the code dataset alone reports as `bpb`.
"""

from __future__ import annotations

import hashlib

from train.data import corpora, named, prepared
from train.data.corpora import TextSplit
from train.data.mixture import MixtureSource
from train.data.streams import text_stream
from train.data.token_source import stream_eval_batches


def _stream(name: str, path: str, tokenizer):
  """(the token stream, what config.json's `_run.data.eval_corpora` records of it)."""
  what = f"config.eval.corpora: {name}={path!r}: the run's tokenizer"
  files = corpora.eval_corpus_files(name, path)
  if files is None:
    stream = prepared.validation_stream(path, tokenizer, what)
    manifest = prepared.open_manifest(prepared.Store(path))
    digest = hashlib.sha256("".join(s["sha256"] for s in manifest["sources"]).encode())
    return stream, {"path": path, "kind": "prepared (validation split)",
                    "files": len(manifest["sources"]), "documents": stream.documents,
                    "fingerprint": f"sha256:{digest.hexdigest()[:16]}", "tokens": len(stream)}
  texts, digest = [], hashlib.sha256()
  for f in files:
    texts.append(corpora.read_text(f))
    digest.update(texts[-1].encode())
  stream = text_stream(tokenizer, TextSplit(files, texts))
  return stream, {"path": path, "kind": "text", "files": len(files), "documents": len(files),
                  "fingerprint": f"sha256:{digest.hexdigest()[:16]}", "tokens": len(stream)}


def _streams(config, source) -> dict:
  """name -> (stream, record), built once per source (the trainer records them before
  its evaluator reads them)."""
  key = config.eval.corpora or ""
  cached = getattr(source, "_eval_corpora", None)
  if cached is not None and cached[0] == key:
    return cached[1]
  out = {}
  if isinstance(source, MixtureSource):
    out.update({name: (domain.val, {"kind": "mixture domain (validation split)",
                                    "tokens": len(domain.val)})
                for name, domain in source.domains.items()})
  for name, path in named.named_paths(key, "eval.corpora").items():
    if name in out:
      raise ValueError(f"config.eval.corpora: {name!r} is also a domain of data.mixture "
                       "(evaluated already); give the corpus another name")
    out[name] = _stream(name, path, source.tokenizer)
  source._eval_corpora = (key, out)  # pylint: disable=protected-access
  return out


def eval_streams(config, source) -> dict:
  """name -> the token stream evaluated under that name."""
  return {name: stream for name, (stream, _) in _streams(config, source).items()}


def describe(config, source) -> dict:
  """name -> what each evaluation corpus is (config.json's `_run.data.eval_corpora`):
  kind, path, files, fingerprint (of the text, or of a prepared dataset's sources),
  tokens in it and tokens each eval reads (eval.batches x eval.batch_size x seq_len,
  windows repeating when the corpus is smaller)."""
  read = int(config.eval.batches) * int(config.eval.batch_size) * int(config.data.seq_len)
  return {name: {**record, "evaluated_tokens": read}
          for name, (_, record) in _streams(config, source).items()}


def corpus_batches(config, source) -> dict[str, list[dict]]:
  """name -> this host's rows of the corpus's fixed eval batches."""
  e, seq_len = config.eval, int(config.data.seq_len)
  return {name: stream_eval_batches(stream, source.vocab_size, int(e.batch_size), seq_len,
                                    int(e.batches), source.process_index,
                                    source.process_count)
          for name, stream in eval_streams(config, source).items()}

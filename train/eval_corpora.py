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

from train.data import corpora, named, prepared
from train.data.corpora import TextSplit
from train.data.mixture import MixtureSource
from train.data.streams import text_stream
from train.data.token_source import stream_eval_batches


def _stream(name: str, path: str, tokenizer):
  what = f"config.eval.corpora: {name}={path!r}: the run's tokenizer"
  files = corpora.eval_corpus_files(name, path)
  if files is None:
    return prepared.validation_stream(path, tokenizer, what)
  return text_stream(tokenizer, TextSplit(files, [corpora.read_text(f) for f in files]))


def eval_streams(config, source) -> dict:
  """name -> the token stream evaluated under that name."""
  out = {}
  if isinstance(source, MixtureSource):
    out.update({name: domain.val for name, domain in source.domains.items()})
  for name, path in named.named_paths(config.eval.get("corpora", ""), "eval.corpora").items():
    if name in out:
      raise ValueError(f"config.eval.corpora: {name!r} is also a domain of data.mixture "
                       "(evaluated already); give the corpus another name")
    out[name] = _stream(name, path, source.tokenizer)
  return out


def corpus_batches(config, source) -> dict[str, list[dict]]:
  """name -> this host's rows of the corpus's fixed eval batches."""
  e, seq_len = config.eval, int(config.data.seq_len)
  return {name: stream_eval_batches(stream, source.vocab_size, int(e.batch_size), seq_len,
                                    int(e.batches), source.process_index,
                                    source.process_count)
          for name, stream in eval_streams(config, source).items()}

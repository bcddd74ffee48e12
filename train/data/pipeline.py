"""The data pipeline: `make_source`, the one place that picks and builds a run's data
source from its config's `data` section.

    source = make_source(config.data, workdir, jax.process_index(), jax.process_count())
    it = source.train_iterator(seed, config.data.batch_size, config.data.seq_len)
    batch = next(it)              # this host's rows of the global batch
    state = it.get_state()        # JSON-serialisable; it.set_state(state) resumes exactly
    evals = source.eval_batches(config.eval.batch_size, 2 * config.data.seq_len, 8)

Every source implements train/data/source.py's `Source` (the batch format is
described there): DataSource (train/data/token_source.py) for a tokenized corpus,
MQARSource (train/data/mqar.py) for synthetic recall.
"""

from __future__ import annotations

from train.data import corpora, mqar
from train.data.source import Source
from train.data.streams import token_streams
from train.data.token_source import DataSource
from train.data.tokenizers import load_tokenizer


def make_source(data_cfg, workdir: str | None, process_index: int = 0,
                process_count: int = 1, read_only: bool = False) -> Source:
  """Builds the data source described by the config's `data` section, top-down:
  corpus (resolved and split) -> tokenizer (trained on, or loaded for, the train
  split) -> token streams -> grain datasets (DataSource). Text corpora are split
  by document and tokenized in memory; `.bin` corpora stay memmapped, validation
  being their last `data.val_fraction` of tokens. "mqar" is the synthetic recall
  task (train/data/mqar.py), which has none of these steps.
  `read_only`: never write to `workdir` (a tokenizer trained here is not cached).
  """
  if data_cfg.corpus == "mqar":
    return mqar.make_source(data_cfg, process_index, process_count)
  corpus = corpora.load(data_cfg)
  tokenizer = load_tokenizer(data_cfg, workdir, cache=not read_only,
                             train_texts=corpus.train.texts if corpus.train else None)
  train, val = token_streams(corpus, tokenizer)
  info = {"corpus": data_cfg.corpus, "tokenizer": data_cfg.tokenizer,
          "vocab_size": tokenizer.vocab_size, "train_tokens": len(train),
          "val_tokens": len(val), "val_documents": val.names}
  source = DataSource(tokenizer, train, val, process_index, process_count,
                      shuffle_buffer=int(data_cfg.get("shuffle_buffer", 0)),
                      worker_count=int(data_cfg.get("worker_count", 0)), info=info)
  if data_cfg.get("passkey_fraction"):
    from train.data.passkey import PasskeyMix  # pylint: disable=g-import-not-at-top
    source = PasskeyMix(source, float(data_cfg.passkey_fraction),
                        int(data_cfg.get("passkey_needles", 1)))
  return source

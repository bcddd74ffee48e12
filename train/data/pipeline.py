"""The data pipeline: `make_source`, the one place that picks and builds a run's data
source from its config's `data` section.

    source = make_source(config.data, workdir, jax.process_index(), jax.process_count())
    it = source.train_iterator(seed, config.data.batch_size, config.data.seq_len)
    batch = next(it)              # this host's rows of the global batch
    state = it.get_state()        # JSON-serialisable; it.set_state(state) resumes exactly
    evals = source.eval_batches(config.eval.batch_size, 2 * config.data.seq_len, 8)

Every source implements train/data/source.py's `Source` (the batch format is
described there): DataSource (train/data/token_source.py) for a tokenized corpus,
MQARSource (train/data/mqar.py) for synthetic recall, MixtureSource
(train/data/mixture.py) for a weighted mixture of prepared datasets.
"""

from __future__ import annotations

from train.data import corpora, mqar, named, prepared
from train.data.mixture import MixtureSource
from train.data.passkey import PasskeyMix
from train.data.source import Source
from train.data.streams import token_streams
from train.data.token_source import DataSource
from train.data.tokenizers import fingerprint, load_tokenizer, require_tokenizer


def make_source(data_cfg, workdir: str | None, process_index: int = 0,
                process_count: int = 1, read_only: bool = False,
                expect_tokenizer: str | None = None) -> Source:
  """Builds the data source described by the config's `data` section, top-down:
  corpus (resolved and split) -> tokenizer (trained on, or loaded for, the train
  split) -> token streams -> grain datasets (DataSource). Text corpora are split
  by document and tokenized in memory; `.bin` corpora stay memmapped, validation
  being their last `data.val_fraction` of tokens. A prepared dataset (a directory
  `--mode prepare` wrote, or a gs:// / s3:// URL of one) is read as prepared, its
  own splits and tokenizer (train/data/prepared.py). "mqar" is the synthetic recall
  task (train/data/mqar.py), which has none of these steps.
  `read_only`: never write to `workdir` (nor train a tokenizer for it).
  `expect_tokenizer`: the run's recorded tokenizer fingerprint (load_tokenizer's `expect`).
  `info` is what config.json's `_run.data` records: what the model is trained on.
  """
  if data_cfg.corpus == "mqar":
    source = mqar.make_source(data_cfg, process_index, process_count)
    require_tokenizer(source.tokenizer, expect_tokenizer, lambda got, want: (
        f"config.data.corpus='mqar': its tokenizer ({got}) is not the one the run in "
        f"{workdir} was trained with ({want}, in its config.json)"))
    return source
  if data_cfg.corpus == "mixture":
    return _mixture(data_cfg, workdir, process_index, process_count, read_only,
                    expect_tokenizer)
  if prepared.is_prepared(data_cfg.corpus):
    tokenizer, train, val, info = prepared.open_dataset(
        data_cfg.corpus, data_cfg, workdir, cache=not read_only, expect=expect_tokenizer)
    return _data_source(data_cfg, tokenizer, train, val, info, process_index, process_count)
  corpus = corpora.load(data_cfg)
  tokenizer = load_tokenizer(data_cfg, workdir, cache=not read_only,
                             train_texts=corpus.train.texts if corpus.train else None,
                             expect=expect_tokenizer)
  if corpus.pieces is not None:
    corpora.check_token_ids(corpus.pieces, tokenizer.vocab_size, data_cfg.tokenizer)
  train, val = token_streams(corpus, tokenizer)
  info = {"corpus": data_cfg.corpus, "files": len(corpus.files) + len(corpus.skipped),
          "tokenizer": data_cfg.tokenizer, "tokenizer_fingerprint": fingerprint(tokenizer),
          "vocab_size": tokenizer.vocab_size, "train_tokens": len(train),
          "val_tokens": len(val),
          "train_documents": len(corpus.train.names) if corpus.train else len(corpus.files),
          "val_documents": val.names, "skipped_documents": corpus.skipped}
  return _data_source(data_cfg, tokenizer, train, val, info, process_index, process_count)


def _data_source(data_cfg, tokenizer, train, val, info, process_index, process_count):
  source = DataSource(tokenizer, train, val, process_index, process_count,
                      shuffle_buffer=int(data_cfg.shuffle_buffer),
                      worker_count=int(data_cfg.worker_count), info=info)
  if data_cfg.passkey_fraction:  # train/data/passkey.py
    source = PasskeyMix(source, float(data_cfg.passkey_fraction),
                        int(data_cfg.passkey_needles))
  return source


def _mixture(data_cfg, workdir, process_index, process_count, read_only,
             expect_tokenizer) -> MixtureSource:
  """data.mixture's weights over data.datasets' prepared datasets (one tokenizer)."""
  paths = named.named_paths(data_cfg.datasets, "data.datasets")
  weights = named.mixture_weights(data_cfg.mixture, paths)
  domains, infos = {}, {}
  for name in weights:
    if not prepared.is_prepared(paths[name]):
      raise ValueError(f"config.data.datasets: {name}={paths[name]!r} is not a prepared "
                       "dataset; a mixture reads prepared datasets (launch.py --mode prepare)")
    tokenizer, train, val, infos[name] = prepared.open_dataset(
        paths[name], data_cfg, workdir, cache=not read_only, expect=expect_tokenizer)
    domains[name] = _data_source(data_cfg, tokenizer, train, val, infos[name],
                                 process_index, process_count)
  rows, share = mixture_shares(weights, infos, data_cfg.mixture_unit)
  info = {"corpus": "mixture", "mixture": weights, "mixture_unit": data_cfg.mixture_unit,
          "mixture_share": share, "datasets": infos,
          "tokenizer": data_cfg.tokenizer,  # Every domain's: open_dataset checked each.
          "tokenizer_fingerprint": infos[name]["tokenizer_fingerprint"],
          "vocab_size": tokenizer.vocab_size}
  return MixtureSource(tokenizer, domains, rows, process_index, process_count, info=info)


def mixture_shares(weights: dict[str, float], infos: dict[str, dict],
                   unit: str) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
  """(the schedule's row weights, {"tokens": share, "bytes": share} it realises).
  Rows hold seq_len tokens each, so token shares are the row weights; a domain's bytes
  are its tokens times its prepared train split's bytes per token. unit="bytes" sets
  the row weights so that the byte shares are `weights`."""
  per_token = {n: infos[n]["train_bytes"] / max(infos[n]["train_tokens"], 1) for n in weights}
  norm = lambda d: {n: v / sum(d.values()) for n, v in d.items()}
  rows = norm({n: w / per_token[n] for n, w in weights.items()}) if unit == "bytes" else weights
  share = {"tokens": {n: round(v, 6) for n, v in rows.items()},
           "bytes": {n: round(v, 6) for n, v in norm(
               {n: rows[n] * per_token[n] for n in rows}).items()}}
  return rows, share

"""The data path: a run's `data` config -> this host's rows of each global batch.

`pipeline.make_source` is the one place that picks and builds the source; the
training loop, the evaluator and the benchmarks see only the `source.Source`
interface. A text or token corpus goes through, in order:

  corpora.py       resolve `data.corpus` (Shakespeare, .txt files, .bin token files)
                   and split it into train and validation documents
  tokenizers.py    byte, SentencePiece (trained on the train split), tokenizer.json
  streams.py       the tokenized splits as TokenStreams (token arrays + document starts)
  packing.py       a stream's fixed-length windows (segment ids, positions, weights)
  token_source.py  DataSource: shuffled train windows and fixed eval windows as grain
                   datasets, this host's rows only
  mqar.py          MQARSource: synthetic multi-query associative recall (no corpus)

Prepared once (`launch.py --mode prepare`), read as is:

  formats.py       prepare's inputs: .txt, JSONL (.gz, .zst), Parquet, saved HF datasets
  prepare.py       the prepare: workers, ledger, resume, manifest, atomic commit
                   (prepare_work.py per chunk, prepare_out.py writing, prepare_tok.py)
  prepared.py      a prepared dataset as token streams, local or gs:// / s3:// (fsspec)
  mixture.py       MixtureSource: weighted named prepared datasets (data.corpus="mixture")
  named.py         parsing data.datasets, data.mixture and eval.corpora

A new kind of data (another format, a dataset prepared ahead of time, a mixture of
sources) is a `Source` of its own, or a reader that ends in TokenStreams, chosen
in `make_source`.
"""

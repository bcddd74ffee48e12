"""A run directory's bytes: the only code that reads or writes them.

  storage.py           one layer over local paths and fsspec URLs (gs://, s3://, memory://)
  staging.py           a local copy of a bucket run's files for libraries that need a path
  runlog.py            append-only JSON-line logs (metrics.jsonl, config_changes.jsonl, ...)
  jsonfile.py          one JSON object per file, read with a clear error
  checksums.py         a checkpoint's checksums, written at save and checked at restore
  store_checksums.py   their digests: the store's own on a bucket, computed again at restore
  checkpoint_store.py  orbax checkpoints on a bucket: staged, uploaded, committed
  dataset_store.py     a prepared dataset read by byte ranges (or memmapped)
"""

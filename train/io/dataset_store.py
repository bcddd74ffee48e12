"""A prepared dataset's root (train/data/prepared.py reads it), local or any fsspec URL.

Local files are memmapped; anything else is read by byte ranges (`RangeArray`), one
window at a time, so nothing is copied whole to any host. It is kept apart from
storage.py (the run directory's layer) on purpose: a dataset is only read, a range at a
time on the data path, without storage.py's retries or its `REQUESTS` count (the
figures in docs/PERFORMANCE.md count a run's own writes), and a store that cannot be
opened is a config error (ValueError naming data.corpus), not a StorageError.
"""

from __future__ import annotations

import os

import numpy as np


class Store:
  """A prepared dataset's root, through fsspec. Pickles by URL (grain workers reopen it)."""

  def __init__(self, url: str):
    import fsspec  # pylint: disable=g-import-not-at-top
    self.url = url
    try:
      self.fs, self.root = fsspec.core.url_to_fs(os.path.expanduser(url))
    except (ImportError, ValueError) as e:
      raise ValueError(f"data.corpus={url!r}: cannot open this storage ({e}); gs:// needs "
                       "`pip install gcsfs`, s3:// needs `pip install s3fs`") from None
    self.local = "file" in _protocols(self.fs)

  def __reduce__(self):
    return Store, (self.url,)

  def path(self, rel: str) -> str:
    return f"{self.root.rstrip('/')}/{rel}"

  def exists(self, rel: str) -> bool:
    return self.fs.exists(self.path(rel))

  def read(self, rel: str, start: int | None = None, end: int | None = None) -> bytes:
    return self.fs.cat_file(self.path(rel), start=start, end=end)

  def sizes(self, rel_dir: str) -> dict[str, int]:
    """name -> size of the files in a directory (one listing call)."""
    return {os.path.basename(e["name"].rstrip("/")): int(e["size"])
            for e in self.fs.ls(self.path(rel_dir), detail=True)}

  def array(self, rel: str, dtype: str, length: int):
    if self.local:
      return np.memmap(self.path(rel), dtype=dtype, mode="r", shape=(length,))
    return RangeArray(self, rel, dtype, length)


def _protocols(fs) -> tuple:
  p = fs.protocol
  return tuple(p) if isinstance(p, (tuple, list)) else (p,)


class RangeArray:
  """A 1-D array in a remote file; slicing reads exactly that byte range."""

  def __init__(self, store: Store, rel: str, dtype: str, length: int):
    self.store, self.rel, self.dtype, self.length = store, rel, np.dtype(dtype), length

  def __len__(self) -> int:
    return self.length

  def __getitem__(self, s: slice) -> np.ndarray:
    a, b, _ = s.indices(self.length)
    if b <= a:
      return np.zeros([0], self.dtype)
    n = self.dtype.itemsize
    return np.frombuffer(self.store.read(self.rel, a * n, b * n), self.dtype)

"""Local copies for libraries that need files (tokenizers, matplotlib, tensorboardX):
the bridge between a local directory and a run on object storage (train/io/storage.py)."""

from __future__ import annotations

import contextlib
import os
import tempfile

from train.io.storage import copy_tree, is_url, join, listdir, read_bytes, write_bytes


def upload_dir(local: str, url: str) -> list[str]:
  """Every file under the local directory `local` written to the same place under `url`
  (one PUT each); returns the URLs written."""
  return [join(url, *rel.split(os.sep)) for rel in copy_tree(local, url)]


@contextlib.contextmanager
def staged(workdir: str | None, subdir: str):
  """For a library that reads and writes files in `workdir/subdir/` (a tokenizer): the
  local `workdir` itself, or, for a URL, a temporary stand-in directory holding a copy
  of `subdir/`; files it gains are uploaded on exit by process 0 only (one writer of a
  run's records). Errors name the run's own paths, not the stand-in's."""
  if not workdir or not is_url(workdir):
    yield workdir
    return
  remote = join(workdir, subdir)
  with tempfile.TemporaryDirectory(prefix="run-staged-") as local:
    os.makedirs(os.path.join(local, subdir))
    had = listdir(remote)
    for name in had:
      with open(os.path.join(local, subdir, name), "wb") as f:
        f.write(read_bytes(join(remote, name)))
    try:
      yield local
    except (ValueError, FileNotFoundError) as e:
      raise type(e)(str(e).replace(local, str(workdir).rstrip("/"))) from None
    import jax  # pylint: disable=g-import-not-at-top
    if jax.process_index() == 0:
      for name in sorted(set(os.listdir(os.path.join(local, subdir))) - set(had)):
        with open(os.path.join(local, subdir, name), "rb") as f:
          write_bytes(join(remote, name), f.read())

"""SIGTERM / SIGINT as a flag: a job being stopped (preemption, Ctrl-C, `kill`) gets to
save and clean up, instead of Python's default SIGTERM ending it mid-step."""

from __future__ import annotations

import os
import signal
import sys
import threading

PARENT_ENV = "BLOCKWORK_DIE_WITH_PARENT"  # The pid whose death ends this process.
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> bool:
  """When $BLOCKWORK_DIE_WITH_PARENT names this process's parent (a `--sweep_parallel`
  sweep sets it for its points), the kernel sends SIGTERM here when that parent dies,
  even by SIGKILL, which it cannot pass on: the point saves a checkpoint and exits
  (SIGTERM is preemption) instead of training on as an orphan. Linux only (prctl
  PR_SET_PDEATHSIG); True when armed. A parent gone before it was armed: exits now."""
  parent = os.environ.get(PARENT_ENV)
  if not parent or not sys.platform.startswith("linux"):
    return False
  import ctypes  # pylint: disable=g-import-not-at-top
  libc = ctypes.CDLL(None, use_errno=True)
  if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
    return False
  if str(os.getppid()) != parent:  # It died before prctl: no signal will come.
    os.kill(os.getpid(), signal.SIGTERM)
  return True


class StopSignals:
  """While entered (in the main thread), SIGTERM and SIGINT set `flag`; the previous
  handlers come back on exit. Elsewhere (a worker thread) it never sets the flag."""

  def __init__(self):
    self.flag = threading.Event()
    self.previous = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self.previous[sig] = signal.signal(sig, lambda *_: self.flag.set())
    return self

  def __exit__(self, *exc):
    for sig, handler in self.previous.items():
      signal.signal(sig, handler)

"""SIGTERM / SIGINT as a flag: a job being stopped (preemption, Ctrl-C, `kill`) gets to
save and clean up, instead of Python's default SIGTERM ending it mid-step."""

from __future__ import annotations

import signal
import threading


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

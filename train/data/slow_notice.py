"""A log line for work that turns out slow (e.g. SentencePiece training on a large corpus)."""

from __future__ import annotations

import logging
import threading
import time



class SlowNotice:
  """Logs `what` to `log` once it has run `after_s` seconds (with the lines read so
  far), and its end with the time taken; a quick run logs nothing."""

  def __init__(self, what: str, read: dict[str, int], after_s: float, log: logging.Logger):
    self.what, self.read, self.fired = what, read, False
    self.after_s, self.log = after_s, log
    self.timer = threading.Timer(after_s, self._notice)
    self.timer.daemon = True

  def _notice(self):
    self.fired = True
    self.log.info("%s: still running after %.0f s (%d lines, %.1f M characters read)...",
                  self.what, self.after_s, self.read["lines"], self.read["chars"] / 1e6)

  def __enter__(self):
    self.start = time.monotonic()
    self.timer.start()
    return self

  def __exit__(self, *exc):
    self.timer.cancel()
    if self.fired and exc[0] is None:
      self.log.info("%s: done in %.0f s (%d lines)", self.what,
                    time.monotonic() - self.start, self.read["lines"])

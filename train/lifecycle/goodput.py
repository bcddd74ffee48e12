"""Goodput: where a run's wall time went, attempt by attempt, from the run directory alone.

Each attempt (one process training the run: from its process start to its exit or kill)
keeps a ledger. `lap(category)` charges the time since the previous lap to one of
CATEGORIES; the laps are contiguous from the process start, so an attempt's categories
sum to its wall time. Process 0 appends the attempt's totals so far (a record) to
RUN/goodput.jsonl after each checkpoint save (either tier), every FLUSH_S seconds and
when it ends: the run log's append
(train/io/runlog.py: one file locally, a new segment object on a bucket, never written
twice for a retried request whose answer was lost). Records are cumulative, so a lost or
repeated one changes nothing: an attempt is its last record.

`summary(workdir)`: the attempts in order; "between" is the time from an attempt's last
record to the next one's process start (a restart's wait, and the work a kill lost after
the last record); the categories then sum to the run's wall time, first process start to
last record, and goodput is productive / wall.

Categories: startup (process start, imports, lock, session, state init), restore (a
checkpoint read on resume or rollback), compile (the train step's, once per attempt), data
(getting the next batch: with asynchronous dispatch this overlaps the device's previous
step), productive (steps not trained before), redone (steps an earlier attempt, or this one
before a rollback, already trained: found from the step numbers in metrics.jsonl,
metrics.rewound.jsonl and this file), eval (in-loop evaluation, its compile included),
checkpoint (the loop waiting on a save, persistent or local tier, and on pending saves at
exit), between.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
import uuid

from train.hostenv import START_ENV
from train.io import runlog
from train.metrics import METRICS_FILE, REWOUND_FILE

GOODPUT_FILE = "goodput.jsonl"
CATEGORIES = ("productive", "redone", "compile", "data", "checkpoint", "restore", "eval",
              "startup", "between")
FLUSH_S = 10.0  # An attempt's record is appended at least this often while it trains.
RECORD_KEYS = frozenset({"attempt", "start", "time", "step", "seconds", "steps"})


def _os_start() -> float | None:
  """The kernel's record of this process's start (Linux), as a time.time() value: it
  covers the interpreter's own start-up, before launch.py's first statement."""
  try:
    with open("/proc/self/stat") as f:
      ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # Field 22: starttime.
    since_boot = ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)
  except (OSError, ValueError, IndexError, AttributeError):
    return None


def process_start() -> float:
  """When this attempt started: launch.py's process start when it marked one (taken
  once: a second run in the same process starts when it is called), else now (a run
  called from Python)."""
  pid, _, marked = os.environ.pop(START_ENV, "").partition(":")
  if pid != str(os.getpid()):
    return time.time()
  started = _os_start()
  # The kernel's time unless this process was something else long before (an `exec`).
  return started if started is not None and 0 <= float(marked) - started < 5 else float(marked)


def trained_steps(workdir: str) -> int:
  """The highest step any attempt logged (metrics, rewound lines, ledger records)."""
  steps = [r.get("step", 0) for name in (METRICS_FILE, REWOUND_FILE, GOODPUT_FILE)
           for r in runlog.read_records(workdir, name, warn=False)]
  return max((s for s in steps if isinstance(s, int)), default=0)


class Ledger:
  """One attempt's ledger. Nothing is written before `begin` (a refused or finished
  launch leaves the run directory unchanged) nor by a process other than `enabled`."""

  def __init__(self, workdir: str, enabled: bool, start: float | None = None):
    self.workdir, self.enabled = workdir, enabled
    self.start = process_start() if start is None else start
    self.last = self.start  # The previous lap.
    self.seconds = dict.fromkeys(CATEGORIES[:-1], 0.0)
    self.steps = {"productive": 0, "redone": 0}
    self.attempt = uuid.uuid4().hex[:12]
    self.log = runlog.Log(workdir, GOODPUT_FILE)
    self.high = None  # The highest step trained so far by any attempt (None: not begun).
    self.current = (None, "productive")  # The step being charged, and its category.
    self.reached = 0  # This attempt's highest step.
    self.flushed = -math.inf

  def lap(self, category: str, flush: bool = False) -> None:
    """Charges the time since the previous lap to `category`; `flush`: appends the
    record now (after a save: the steps a resume keeps are always in a record)."""
    now = time.time()
    self.seconds[category] += now - self.last
    self.last = now
    if flush or now - self.flushed >= FLUSH_S:
      self.flush()

  def begin(self, step: int) -> None:
    """Training starts after `step`: the steps earlier attempts trained past it are redone."""
    self.high = max(step, trained_steps(self.workdir) if self.enabled else 0)
    self.reached = step
    self.flush()

  def step(self, step: int) -> None:
    """Charges the time since the previous lap to train step `step`: redone when some
    attempt trained it before, productive otherwise (a step charged twice counts once)."""
    if step != self.current[0]:
      kind = "redone" if step <= self.high else "productive"
      self.current, self.high = (step, kind), max(self.high, step)
      self.steps[kind] += 1
      self.reached = step
    self.lap(self.current[1])

  def record(self) -> dict:
    return {"attempt": self.attempt, "start": self.start, "time": self.last,
            "step": self.reached, "seconds": dict(self.seconds), "steps": dict(self.steps)}

  def flush(self) -> None:
    self.flushed = time.time()
    if self.enabled and self.high is not None:
      self.log.append([json.dumps(self.record()) + "\n"])

  def close(self) -> None:
    """The attempt's end: what is left (closing the checkpoint managers waits for the
    pending saves) is checkpoint time; the last record."""
    self.lap("checkpoint")
    self.flush()


@dataclasses.dataclass(frozen=True)
class Goodput:
  """A run's goodput: `seconds` (every category, "between" included) sums to `wall_s`."""
  goodput: float  # productive / wall_s.
  wall_s: float  # The first attempt's process start to the last record.
  seconds: dict[str, float]
  steps: dict[str, int]  # Steps trained: {"productive": n, "redone": m}.
  attempts: list[dict]  # Each attempt's last record, in order, with its "between_s" after.

  def fractions(self) -> dict[str, float]:
    return {k: v / self.wall_s if self.wall_s > 0 else math.nan
            for k, v in self.seconds.items()}


def summary(workdir: str) -> Goodput | None:
  """The run's goodput from RUN/goodput.jsonl; None when no attempt recorded one."""
  last: dict[str, dict] = {}
  for r in runlog.read_records(workdir, GOODPUT_FILE, warn=False):
    if RECORD_KEYS <= r.keys() and r["time"] >= last.get(r["attempt"], {"time": -math.inf})["time"]:
      last[r["attempt"]] = r
  attempts = sorted(last.values(), key=lambda r: r["start"])
  if not attempts:
    return None
  seconds = dict.fromkeys(CATEGORIES, 0.0)
  steps = {"productive": 0, "redone": 0}
  for i, a in enumerate(attempts):
    for k, v in a["seconds"].items():
      seconds[k] = seconds.get(k, 0.0) + v
    for k, v in a["steps"].items():
      steps[k] = steps.get(k, 0) + v
    a["between_s"] = attempts[i + 1]["start"] - a["time"] if i + 1 < len(attempts) else 0.0
    seconds["between"] += a["between_s"]
  wall = attempts[-1]["time"] - attempts[0]["start"]
  return Goodput(seconds["productive"] / wall if wall > 0 else math.nan, wall, seconds,
                 steps, attempts)

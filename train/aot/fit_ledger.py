"""The `--fit` search's ledger: every finished trial, in the search's JSON, written after
each trial, so a stopped search (SIGTERM, a lost host) keeps what it compiled and a re-run
with the same arguments reuses it instead of compiling again (docs/compile.md).

  ledger = Ledger.open(out, search_key(config, topo))   # an earlier run's trials, if any
  ledger.find("full", 8)            # the trial, or None: not compiled yet
  ledger.add(trial); ledger.save(result)

A trial is a fact about (the config without its batch and remat, the topology, the
policy, the per-chip batch): `search_key` hashes what decides it, and a file that holds
another search is refused by name, never overwritten.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from train.aot.topology import Topology
from train.io import jsonfile, storage

SIGTERM_EXIT = 128 + signal.SIGTERM  # 143: what a shell reports for a SIGTERM'd process.


def search_key(config, topo: Topology) -> str:
  """What decides every trial's outcome: the config with the fields the search sets
  (batch sizes, remat) blanked, and the topology."""
  c = copy.deepcopy(config)
  c.data.batch_size = c.eval.batch_size = 0
  c.model.remat = c.model.remat_custom = ""
  text = json.dumps({"config": json.loads(c.to_json_best_effort(sort_keys=True)),
                     "topology": topo.name, "num_slices": topo.num_slices}, sort_keys=True)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


class Ledger:
  """The trials of one search, kept in its JSON at `out` (a path or a bucket URL)."""

  def __init__(self, out: str | None, key: str, trials: list[dict], rooflines: list[dict]):
    self.out, self.key = out, key
    self.trials, self.rooflines = trials, rooflines
    self.reused = 0  # Trials answered from the file, this run.

  @classmethod
  def open(cls, out: str | None, key: str) -> Ledger:
    """The ledger at `out`: empty when there is no file (or no `out`: kept in memory); an
    earlier run's trials when it holds this search; a ValueError naming the file when it
    holds anything else."""
    if out is None or not storage.exists(out):
      return cls(out, key, [], [])
    old = jsonfile.read_json_object(out)
    if old.get("search_key") != key:
      what = ("a fit search of other arguments" if "search_key" in old
              else "no fit search's trials")
      raise ValueError(f"--out {out} holds {what} (its search_key "
                       f"{old.get('search_key')!r}, this search's {key!r}): pass another "
                       f"--out, or move that file away to search afresh")
    return cls(out, key, list(old.get("trials", [])), list(old.get("rooflines", [])))

  def find(self, remat: str, per_chip: int, roofline: bool = False) -> dict | None:
    for t in self.rooflines if roofline else self.trials:
      if t["remat"] == remat and t["per_chip"] == per_chip:
        self.reused += 1
        return t
    return None

  def add(self, trial: dict, roofline: bool = False) -> None:
    (self.rooflines if roofline else self.trials).append(trial)

  def save(self, result: dict[str, Any]) -> None:
    """`result` with the ledger, written whole (a reader never sees half a file)."""
    if self.out is None:
      return
    storage.write_text(self.out, json.dumps(
        {**result, "search_key": self.key, "trials": self.trials,
         "rooflines": self.rooflines}, indent=1))


@contextlib.contextmanager
def exit_on_sigterm(describe: Callable[[], str]) -> Iterator[Callable[[], None]]:
  """While entered (main thread): SIGTERM prints `describe()` and ends the process at
  once with status 143; what the ledger wrote stays. Yields `arm`, to call after libtpu
  has loaded and before each compile.

  A compile runs in C++ for minutes: a Python handler alone would wait for it to
  return, and libtpu's own handler (installed when it loads) prints a crash dump. `arm`
  puts Python's handler back in front of libtpu's; Python's C-level handler writes the
  signal to a wakeup fd, and a thread reading it ends the process while the compile
  runs (it holds no GIL)."""
  read_fd, write_fd = os.pipe()
  os.set_blocking(write_fd, False)

  def stop(*_):  # Reached only when the main thread gets there first.
    _exit(describe)

  def watch():
    while data := os.read(read_fd, 64):
      if signal.SIGTERM in data:
        _exit(describe)
    os.close(read_fd)

  arm = lambda: signal.signal(signal.SIGTERM, stop)
  previous, previous_fd = signal.getsignal(signal.SIGTERM), signal.set_wakeup_fd(write_fd)
  arm()
  threading.Thread(target=watch, daemon=True, name="fit-sigterm").start()
  try:
    yield arm
  finally:
    signal.signal(signal.SIGTERM, previous)
    signal.set_wakeup_fd(previous_fd)
    os.close(write_fd)  # The thread reads EOF and ends.


def _exit(describe: Callable[[], str]) -> None:
  try:
    print(describe(), flush=True)
    sys.stderr.flush()
  finally:
    os._exit(SIGTERM_EXIT)  # pylint: disable=protected-access

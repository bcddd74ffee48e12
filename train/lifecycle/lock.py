"""One trainer per run directory: process 0 holds `RUN/LOCK`, which names its holder."""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import sys
import time

from train.io import storage

log = logging.getLogger(__name__)

LOCK_FILE = "LOCK"


class LockError(RuntimeError):
  pass


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def live_holder(workdir: str) -> dict | None:
  """The record of the trainer holding `workdir`'s LOCK, None when there is none or its
  holder (a process on this host) is dead; a holder on another host, whose liveness
  cannot be checked from here, is returned with "unverified": True. Readers (the
  report, a re-run sweep) use it: a run whose trainer still holds its lock is running,
  whatever its metrics.jsonl says so far."""
  holder = WorkdirLock(workdir)._holder()  # pylint: disable=protected-access
  if not holder or "garbage" in holder:
    return None
  if holder.get("host") != socket.gethostname():
    return {**holder, "unverified": True}
  return holder if _alive(holder["pid"]) and holder["pid"] != os.getpid() else None


def describe_holder(holder: dict) -> str:
  where = (f"pid {holder.get('pid')} on host {holder.get('host')} since {holder.get('since')}")
  if holder.get("unverified"):
    return (f"{LOCK_FILE} held by {where}, which cannot be checked from this host: still "
            f"training, or killed without releasing it (then delete {LOCK_FILE})")
  return f"still training: {LOCK_FILE} held by {where}"


class WorkdirLock:
  """`RUN/LOCK` (created exclusively) names its holder: host, pid, start time, command.

  A lock whose holder ran on this host and is no longer alive is stale (a killed
  job): it is taken over with a warning. One held by a live process, or by a
  process on another host (whose liveness cannot be checked from here), is refused
  with the holder's details and how to clear it.
  """

  def __init__(self, workdir: str, enabled: bool = True):
    self.workdir = workdir
    self.path = storage.join(workdir, LOCK_FILE)
    self.enabled = enabled
    self.held = False

  def _holder(self) -> dict:
    """The holder's record; {} while unreadable (just created, not yet written), and
    {"garbage": first bytes} for a file that is not a lock's record."""
    for attempt in range(3):
      try:
        raw = storage.read_bytes(self.path)[:4096]
      except FileNotFoundError:
        return {}
      try:
        holder = json.loads(raw)
      except (ValueError, RecursionError):
        holder = None
      if isinstance(holder, dict) and isinstance(holder.get("pid"), int):
        return holder
      if attempt < 2:
        time.sleep(0.2)  # A holder between creating the file and writing it.
    return {"garbage": raw[:80]}

  def _try_create(self) -> bool:
    since = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    record = {"host": socket.gethostname(), "pid": os.getpid(), "since": since,
              "command": " ".join(sys.argv)}
    # Atomic create-if-absent: O_EXCL locally, If-None-Match / ifGenerationMatch on a bucket.
    return storage.create_exclusive(self.path, json.dumps(record).encode())

  def acquire(self) -> None:
    if not self.enabled:
      return
    storage.makedirs(self.workdir)
    for _ in range(2):
      if self._try_create():
        self.held = True
        return
      holder = self._holder()
      if "garbage" in holder:
        raise LockError(
            f"{self.path} exists but is not a lock record (it holds {holder['garbage']!r}; "
            "a trainer writes its host, pid and command there). If no trainer is using "
            f"{self.workdir}, delete {self.path} and re-run.")
      if not holder:  # Released between our attempt and the read: try again.
        continue
      host, pid = holder.get("host"), holder.get("pid")
      who = (f"pid {pid} on host {host} since {holder.get('since')} "
             f"(command: {holder.get('command')})")
      if host == socket.gethostname() and isinstance(pid, int) and pid != os.getpid():
        if _alive(pid):
          raise LockError(f"{self.workdir} is in use by another trainer: {who}. "
                          "Wait for it to finish or stop it; two trainers on one run "
                          "directory would write every line twice.")
        log.warning("stale lock %s: its holder, %s, is no longer running (killed?); "
                    "taking it over", self.path, who)
        storage.delete(self.path)
        continue
      raise LockError(
          f"{self.workdir} is locked by {who}, which cannot be checked from "
          f"host {socket.gethostname()}. If that process is no longer running, delete "
          f"{self.path} and re-run.")
    raise LockError(f"could not take {self.path}: another process took it at the same time")

  def release(self) -> None:
    if self.held:
      self.held = False
      storage.delete(self.path)

  def __enter__(self):
    self.acquire()
    return self

  def __exit__(self, *exc):
    self.release()

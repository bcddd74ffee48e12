"""One trainer per run directory: process 0 holds `RUN/LOCK`, a lease that names its holder.

The holder's record (host, pid, start, command, a token of this holding, when it was last
renewed and for how long a renewal holds) is created if absent and renewed by a
background thread every quarter of the lease (train/io/conditional.py: each write
conditional on the version the holder wrote last). A thread, not the training loop,
because the loop can spend longer than any sensible lease in one compile, restore or
evaluation without being dead; the thread is a daemon (it dies with the process) and
stops when the lock is released.

A LOCK is stale when its holder ran on this host and its pid is gone (at once), or when
it has not been renewed for its lease (a holder on another host: a preempted pod's old
hosts). A stale LOCK is taken over by a conditional replace of the exact record read, so
of two starters that both saw it stale exactly one wins. `release()` deletes the LOCK
only while it is still this holder's record.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import sys
import threading
import time

from train.io import conditional, storage

log = logging.getLogger(__name__)

LOCK_FILE = "LOCK"
# How long a LOCK holds without a renewal (train.lock_lease_s; docs/scaling.md,
# "The LOCK's lease").
LEASE_S = 120.0


class LockError(RuntimeError):
  pass


def _host() -> str:
  return socket.gethostname()


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def _iso(t: float) -> str:
  return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(
      timespec="seconds")


def _age(holder: dict) -> float | None:
  """Seconds since the holder last renewed (None: a record without a lease)."""
  renewed = holder.get("renewed_s")
  return time.time() - renewed if isinstance(renewed, (int, float)) else None


def _expired(holder: dict, lease_s: float) -> bool:
  age = _age(holder)
  return age is not None and age > float(holder.get("lease_s") or lease_s)


def live_holder(workdir: str) -> dict | None:
  """The record of the trainer holding `workdir`'s LOCK, None when there is none or it is
  stale (a dead pid on this host, or a lease not renewed in time). A holder on another
  host within its lease is returned with "remote": True; one whose record has no lease
  (written before leases) with "unverified": True. Readers (the report, a re-run sweep)
  use it: a run whose trainer still holds its lock is running, whatever its
  metrics.jsonl says so far."""
  holder = WorkdirLock(workdir)._holder()  # pylint: disable=protected-access
  if not holder or "garbage" in holder or _expired(holder, LEASE_S):
    return None
  if holder.get("host") != _host():
    return {**holder, "remote": True, "unverified": _age(holder) is None}
  return holder if _alive(holder["pid"]) and holder["pid"] != os.getpid() else None


def describe_holder(holder: dict) -> str:
  where = f"pid {holder.get('pid')} on host {holder.get('host')} since {holder.get('since')}"
  age = _age(holder)
  if age is not None:
    where += (f", last renewed {holder.get('renewed')} ({age:.0f} s ago; it is stale "
              f"after {float(holder.get('lease_s') or LEASE_S):.0f} s without a renewal)")
  if holder.get("unverified"):
    return (f"{LOCK_FILE} held by {where}, which cannot be checked from this host: still "
            f"training, or killed without releasing it (then delete {LOCK_FILE})")
  return f"still training: {LOCK_FILE} held by {where}"


class WorkdirLock:
  """`RUN/LOCK`, held by one trainer and renewed while it runs (the module's docstring).

  A live holder (a live pid on this host, or a lease renewed in time on another) is
  refused with its details; a stale one is taken over with a warning.
  """

  def __init__(self, workdir: str, enabled: bool = True, lease_s: float = LEASE_S):
    self.workdir = workdir
    self.path = storage.join(workdir, LOCK_FILE)
    self.enabled = enabled
    self.lease_s = float(lease_s)
    self.held = False
    self.lost = False  # Taken over by another trainer while held (a missed lease).
    self._version: str | None = None
    self._record: dict = {}
    self._stop = threading.Event()
    self._renewer: threading.Thread | None = None

  def _holder(self, now: conditional.Versioned | None = None) -> dict:
    """The holder's record; {} when there is none, and {"garbage": first bytes} for a
    file that is not a lock's record."""
    now = conditional.read(self.path) if now is None else now
    if now is None:
      return {}
    try:
      holder = json.loads(now.data[:4096])
    except (ValueError, RecursionError):
      holder = None
    if isinstance(holder, dict) and isinstance(holder.get("pid"), int):
      return holder
    return {"garbage": now.data[:80]}

  def _new_record(self) -> bytes:
    t = time.time()
    if not self._record:
      self._record = {"host": _host(), "pid": os.getpid(), "since": _iso(t),
                      "command": " ".join(sys.argv), "token": conditional.new_token(),
                      "lease_s": self.lease_s}
    self._record.update(renewed=_iso(t), renewed_s=round(t, 3))
    return json.dumps(self._record).encode()

  def _refusal(self, holder: dict) -> str | None:
    """Why `holder` may not be taken over (None: it is stale)."""
    host, pid = holder.get("host"), holder.get("pid")
    who = (f"pid {pid} on host {host} since {holder.get('since')} "
           f"(command: {holder.get('command')})")
    if host == _host() and (pid != os.getpid() or holder.get("token") != self._record.get(
        "token")):
      if pid == os.getpid() or _alive(pid):
        return (f"{self.workdir} is in use by another trainer: {who}. Wait for it to "
                "finish or stop it; two trainers on one run directory would write every "
                "line twice.")
      return None
    age = _age(holder)
    if age is None:
      return (f"{self.workdir} is locked by {who}, a record without a lease (written by an "
              f"older version), which cannot be checked from host {_host()}. If that "
              f"process is no longer running, delete {self.path} and re-run.")
    lease = float(holder.get("lease_s") or self.lease_s)
    if age <= lease:
      return (f"{self.workdir} is in use by another trainer: {who}, last renewed "
              f"{holder.get('renewed')} ({age:.0f} s ago). Its lease is {lease:.0f} s: if "
              f"that trainer is gone, {self.path} is taken over once {lease - age:.0f} s "
              "more pass without a renewal (re-run then).")
    return None

  def acquire(self) -> None:
    if not self.enabled:
      return
    storage.makedirs(self.workdir)
    for _ in range(3):
      self._version = conditional.create(self.path, self._new_record())
      if self._version is not None:
        return self._start()
      now = conditional.read(self.path)
      if now is None:  # Released between our attempt and the read: try again.
        continue
      holder = self._holder(now)
      if "garbage" in holder:
        raise LockError(
            f"{self.path} exists but is not a lock record (it holds {holder['garbage']!r}; "
            "a trainer writes its host, pid and command there). If no trainer is using "
            f"{self.workdir}, delete {self.path} and re-run.")
      refusal = self._refusal(holder)
      if refusal:
        raise LockError(refusal)
      why = ("its pid is gone from this host" if holder.get("host") == _host() else
             f"not renewed since {holder.get('renewed')} ({_age(holder):.0f} s)")
      log.warning("stale lock %s of pid %s on host %s (command: %s): %s; taking it over",
                  self.path, holder.get("pid"), holder.get("host"), holder.get("command"), why)
      self._version = conditional.replace_if(self.path, self._new_record(), now.version)
      if self._version is not None:
        return self._start()
    raise LockError(f"could not take {self.path}: another process took it at the same time")

  def _start(self) -> None:
    self.held = True
    self._stop.clear()
    self._renewer = threading.Thread(target=self._renew_loop, daemon=True,
                                     name=f"lease {self.path}")
    self._renewer.start()

  def _renew_loop(self) -> None:
    while not self._stop.wait(self.lease_s / 4):
      try:
        version = conditional.replace_if(self.path, self._new_record(), self._version)
      except OSError as e:  # The store unavailable: the next tick tries again.
        log.warning("renewing %s: %s", self.path, e)
        continue
      if version is None:
        self.lost = True
        log.error("%s was taken over by another trainer (this one missed its %.0f s lease)"
                  "; this trainer no longer holds it", self.path, self.lease_s)
        return
      self._version = version

  def release(self) -> None:
    if not self.held:
      return
    self.held = False
    self._stop.set()
    if self._renewer is not None:
      self._renewer.join()
      self._renewer = None
    if self.lost or not conditional.delete_if(self.path, self._version):
      log.warning("%s is no longer this trainer's: left as it is", self.path)

  def __enter__(self):
    self.acquire()
    return self

  def __exit__(self, *exc):
    self.release()

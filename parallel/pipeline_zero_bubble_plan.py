"""The zero-bubble schedule's timetable (parallel/pipeline_zero_bubble.py), built once per
(stages, microbatches) in Python: which pass each stage runs in each tick, and which slot
of each ring every read and write uses.

Three passes per microbatch and stage, one tick each: F (forward), B (the input's
gradient) and W (the weight gradients). A greedy list schedule in the manner of ZB-H1
(Qi et al. 2023): each tick a stage runs B if it can (the stage below waits for it), else
F, else a deferred W. F needs the activation from the stage before (sent a tick earlier),
B the cotangent from the stage after (the last stage: its own F, which computed the
loss), W its B. A stage starts no F while it holds S microbatches' residuals (F run, W
not): 1F1B's peak (stage 0's), here on every stage. The W's fill the ticks where 1F1B's
stages wait: (S=4, M=8) takes 29 ticks of one pass, against 33 for 1F1B's (M + S - 1)
(F + B + W) and ZB-H1's ideal 3M + S - 1 = 27 (`ticks`)."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

IDLE, FORWARD, FORWARD_LAST, BACKWARD, WEIGHTS = range(5)


def timetable(stages: int, microbatches: int, stash: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """(op [T, S], microbatch [T, S]): the pass each stage runs in each tick; a stage defers
  at most `stash` microbatches' W at once (0: S)."""
  S, M = stages, microbatches
  stash = stash or S
  done = {op: [0] * S for op in (FORWARD, BACKWARD, WEIGHTS)}
  tick_of: dict[tuple[int, int, int], int] = {}
  before = lambda op, s, m, t: tick_of.get((op, s, m), t) < t
  ops, mbs = [], []
  while min(done[WEIGHTS]) < M:
    t, row = len(ops), []
    for s in range(S):
      f, b, w = done[FORWARD][s], done[BACKWARD][s], done[WEIGHTS][s]
      if (b < M and b - w < stash and before(FORWARD, s, b, t)
          and (s == S - 1 or before(BACKWARD, s + 1, b, t))):
        row.append((BACKWARD, b))
      elif f < M and f - w < S and (s == 0 or before(FORWARD, s - 1, f, t)):
        row.append((FORWARD_LAST if s == S - 1 else FORWARD, f))
      elif w < b:
        row.append((WEIGHTS, w))
      else:
        row.append((IDLE, 0))
    for s, (op, m) in enumerate(row):
      op = FORWARD if op == FORWARD_LAST else op
      if op != IDLE:
        tick_of[op, s, m] = t
        done[op][s] += 1
    ops.append([op for op, _ in row])
    mbs.append([m for _, m in row])
  return np.asarray(ops, np.int32), np.asarray(mbs, np.int32)


def ticks(stages: int, microbatches: int, stash: int = 0) -> int:
  """The schedule's length in ticks of one pass."""
  return len(timetable(stages, microbatches, stash)[0])


def bubble_fraction(stages: int, microbatches: int, stash: int = 0) -> float:
  """The idle share of a step whose F, B and W take equal time: 1 - 3M / ticks (ZB-H1's
  ideal (S - 1) / (3M + S - 1); 1F1B's (S - 1) / (M + S - 1))."""
  return 1 - 3 * microbatches / ticks(stages, microbatches, stash)


@dataclasses.dataclass(frozen=True)
class Ring:
  """A ring buffer's plan: `slots`, and per tick and stage the slot written at the tick's
  end (a free one where nothing is) and the slot the tick's pass reads."""

  slots: int
  write_TS: np.ndarray
  read_TS: np.ndarray


def _ring(T: int, S: int, intervals: list[list[tuple[int, int, int]]],
          copy_back: bool = False) -> Ring:
  """Slots for per-stage intervals (write tick, read tick, last read tick): written at the
  end of the write tick, read during the read ticks; a slot is free again for a write at
  the end of its last read tick. Greedy interval colouring. Ticks without a write write
  into a free slot, or a spare one where every slot holds a live value; with copy_back
  (the schedule writes back what such a tick read from its slot), into slot 0."""
  write, read = np.full((T, S), -1, np.int32), np.zeros((T, S), np.int32)
  busy = [[] for _ in range(S)]  # Per stage: (slot, write, last read).
  for s, spans in enumerate(intervals):
    ends: list[int] = []
    for w, r, last in sorted(spans):
      slot = next((j for j, e in enumerate(ends) if e <= w), None)
      if slot is None:
        slot = len(ends)
        ends.append(last)
      ends[slot] = last
      busy[s].append((slot, w, last))
      write[w, s] = slot
      read[r, s] = read[last, s] = slot
  slots = max([1] + [1 + max((j for j, _, _ in b), default=0) for b in busy])
  spare = False
  for s in range(S):
    for t in range(T):
      if write[t, s] < 0 and copy_back:
        write[t, s] = 0
      elif write[t, s] < 0:
        free = [j for j in range(slots) if not any(w < t < e for k, w, e in busy[s] if k == j)]
        write[t, s] = free[0] if free else slots
        spare |= not free
  return Ring(slots + spare, write, read)


@dataclasses.dataclass(frozen=True)
class Plan:
  """The timetable and its five rings: the stage's residuals W reads (F to W) and those
  only B reads (F to B), the stash B leaves W, the activations received (from the stage
  before's F to this stage's F) and the cotangents received (from the stage after's B,
  or the last stage's own F, to B)."""

  op_TS: np.ndarray
  microbatch_TS: np.ndarray
  sends_up_T: np.ndarray  # Whether some stage sends an activation up in the tick.
  sends_down_T: np.ndarray  # Whether some stage sends an input's cotangent down.
  residuals: Ring
  residuals_b: Ring
  stash: Ring
  activations: Ring
  cotangents: Ring


@functools.lru_cache(maxsize=None)
def plan(stages: int, microbatches: int, stash: int = 0) -> Plan:
  op_TS, m_TS = timetable(stages, microbatches, stash)
  T, S = op_TS.shape
  at = {}
  for t in range(T):
    for s in range(S):
      op = FORWARD if op_TS[t, s] == FORWARD_LAST else op_TS[t, s]
      if op != IDLE:
        at[op, s, int(m_TS[t, s])] = t
  ms = range(microbatches)
  residuals = [[(at[FORWARD, s, m], at[BACKWARD, s, m], at[WEIGHTS, s, m]) for m in ms]
               for s in range(S)]
  residuals_b = [[(at[FORWARD, s, m], at[BACKWARD, s, m], at[BACKWARD, s, m]) for m in ms]
                 for s in range(S)]
  stash = [[(at[BACKWARD, s, m], at[WEIGHTS, s, m], at[WEIGHTS, s, m]) for m in ms]
           for s in range(S)]
  acts = [[] if s == 0 else [(at[FORWARD, s - 1, m], at[FORWARD, s, m], at[FORWARD, s, m])
                             for m in ms] for s in range(S)]
  cots = [[(at[BACKWARD, s + 1, m] if s < S - 1 else at[FORWARD, s, m],
            at[BACKWARD, s, m], at[BACKWARD, s, m]) for m in ms] for s in range(S)]
  # A residual or stash slot is one microbatch's residuals: no spare, the schedule copies
  # back; the received rings hold one activation a slot, and keep a spare.
  sends_up = ((op_TS == FORWARD)[:, :S - 1]).any(axis=1)
  sends_down = ((op_TS == BACKWARD)[:, 1:]).any(axis=1)
  return Plan(op_TS, m_TS, sends_up, sends_down, _ring(T, S, residuals, True), _ring(T, S, residuals_b, True),
              _ring(T, S, stash, True),
              _ring(T, S, acts), _ring(T, S, cots))

"""parallel/pipeline_zero_bubble_plan.py: the zero-bubble timetable keeps every dependency
and the memory bound, is shorter than 1F1B's, and its rings hand every pass the value
written for it."""

import pytest

from parallel.pipeline_zero_bubble_plan import (BACKWARD, FORWARD, FORWARD_LAST, IDLE,
                                                WEIGHTS, bubble_fraction, plan, ticks,
                                                timetable)

CASES = [(2, 2), (2, 5), (4, 3), (4, 4), (4, 8), (4, 16), (8, 8), (8, 32)]


def _ticks_of(S, M, stash=0):
  op_TS, m_TS = timetable(S, M, stash)
  at = {}
  for t, (ops, ms) in enumerate(zip(op_TS, m_TS)):
    for s, (op, m) in enumerate(zip(ops, ms)):
      if op != IDLE:
        key = (FORWARD if op == FORWARD_LAST else int(op), s, int(m))
        assert key not in at, f"{key} runs twice"
        at[key] = t
  return op_TS, at


@pytest.mark.parametrize("stash", [0, 1, 2])
@pytest.mark.parametrize("S, M", CASES)
def test_the_timetable_keeps_each_passes_dependencies_and_at_most_s_in_flight(S, M, stash):
  """Every pass once, after what it reads; at most S microbatches' residuals held and at
  most `stash` W's held back (0: S)."""
  op_TS, at = _ticks_of(S, M, stash)
  assert len(at) == 3 * S * M  # F, B and W of every microbatch on every stage, once.
  for s in range(S):
    assert (op_TS[:, s] == FORWARD_LAST).any() == (s == S - 1)  # The loss: the last's.
    for m in range(M):
      f, b, w = at[FORWARD, s, m], at[BACKWARD, s, m], at[WEIGHTS, s, m]
      assert f < b < w
      if s > 0:
        assert at[FORWARD, s - 1, m] < f  # The activation was sent a tick before.
      if s < S - 1:
        assert at[BACKWARD, s + 1, m] < b  # So was the cotangent.
      if m:
        assert at[FORWARD, s, m - 1] < f and at[BACKWARD, s, m - 1] < b
    for t in range(len(op_TS)):  # Residuals held: F run, W not yet; stashed: B run, W not.
      assert sum(at[FORWARD, s, m] <= t < at[WEIGHTS, s, m] for m in range(M)) <= S
      assert sum(at[BACKWARD, s, m] <= t < at[WEIGHTS, s, m] for m in range(M)) <= (stash or S)


@pytest.mark.parametrize("S, M", CASES)
def test_the_timetable_is_near_zb_h1s_ideal_and_shorter_than_1f1b(S, M):
  """Within 2 ticks of 3M + S - 1 from M = S on (equal at M = S), every case under the
  lockstep 1F1B's 3 (M + S - 1); its bubble below (S - 1) / (M + S - 1)."""
  T = ticks(S, M)
  assert T < 3 * (M + S - 1)
  if M >= S:
    assert T <= 3 * M + S + 1
  if M == S:
    assert T == 3 * M + S - 1
  assert bubble_fraction(S, M) < (S - 1) / (M + S - 1)


@pytest.mark.parametrize("stash", [0, 1])
@pytest.mark.parametrize("S, M", CASES)
def test_each_ring_hands_every_read_the_value_written_for_it(S, M, stash):
  """Simulated per stage: the residual rings (W's: F to W; B's alone: F to B) and the
  stash ring (written back where a tick writes nothing) and the received rings (garbage
  where nothing arrives) never lose a live value; the first three have at most S slots."""
  p = plan(S, M, stash)
  op_TS, at = _ticks_of(S, M, stash)
  T = len(op_TS)
  writes = {  # ring -> {(stage, tick): microbatch written there}
      "residuals": {(s, at[FORWARD, s, m]): m for s in range(S) for m in range(M)},
      "residuals_b": {(s, at[FORWARD, s, m]): m for s in range(S) for m in range(M)},
      "stash": {(s, at[BACKWARD, s, m]): m for s in range(S) for m in range(M)},
      "activations": {(s, at[FORWARD, s - 1, m]): m for s in range(1, S) for m in range(M)},
      "cotangents": {(s, at[BACKWARD, s + 1, m] if s < S - 1 else at[FORWARD, s, m]): m
                     for s in range(S) for m in range(M)}}
  reads = {
      "residuals": {(s, at[op, s, m]): m for s in range(S) for m in range(M)
                    for op in (BACKWARD, WEIGHTS)},
      "residuals_b": {(s, at[BACKWARD, s, m]): m for s in range(S) for m in range(M)},
      "stash": {(s, at[WEIGHTS, s, m]): m for s in range(S) for m in range(M)},
      "activations": {(s, at[FORWARD, s, m]): m for s in range(1, S) for m in range(M)},
      "cotangents": {(s, at[BACKWARD, s, m]): m for s in range(S) for m in range(M)}}
  for name, copy_back in (("residuals", True), ("residuals_b", True), ("stash", True),
                          ("activations", False), ("cotangents", False)):
    ring = getattr(p, name)
    for s in range(S):
      slots = [None] * ring.slots
      for t in range(T):
        if (s, t) in reads[name]:
          assert slots[ring.read_TS[t, s]] == reads[name][s, t], (name, s, t)
        if (s, t) in writes[name]:
          slots[ring.write_TS[t, s]] = writes[name][s, t]
        elif not copy_back:
          slots[ring.write_TS[t, s]] = None
  assert max(p.residuals.slots, p.residuals_b.slots) <= S and p.stash.slots <= (stash or S)


def test_a_smaller_stash_costs_ticks():
  """train.pipeline_stash trades memory for time: at (S=8, M=16) a stash of 1 takes 62
  ticks, 2 take 61, S take 57 (ZB-H1's ideal 55; 1F1B's 69)."""
  assert [ticks(8, 16, k) for k in (1, 2, 0)] == [62, 61, 57]

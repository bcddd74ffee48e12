"""benchmarks/pipeline_bubble.py at smoke size: every row has its step times, the
formula and a measured bubble, for M = S, 2S, 4S (S = 2), GPipe, 1F1B and zero bubble."""

import math

import pytest

from benchmarks import common, pipeline_bubble


def test_the_bubble_benchmark_reports_measured_against_formula():
  out = pipeline_bubble.run(common.MODES["smoke"], (2,), rounds=1,
                            schedules=("gpipe", "1f1b", "zero_bubble"))
  rows = out["rows"]
  assert [(r["schedule"], r["microbatches"]) for r in rows] == [
      (s, M) for M in (2, 4, 8) for s in ("gpipe", "1f1b", "zero_bubble")]
  assert [r["formula_bubble"] for r in rows[::3]] == pytest.approx([1 / 3, 1 / 5, 1 / 9])
  # Zero bubble at S = 2: ZB-H1's (S - 1) / (3M + S - 1).
  assert [r["formula_bubble"] for r in rows[2::3]] == pytest.approx([1 / 7, 1 / 13, 1 / 25])
  for r in rows:
    assert r["step_s"] > 0 and r["reference_step_s"] > 0
    assert math.isclose(r["measured_bubble"], 1 - r["reference_step_s"] / r["step_s"])


def test_the_circular_rows_report_measured_against_their_formula():
  """--repeats 2 at smoke size, S = 2: circular rows at M = S, 2S beside GPipe's, with
  (S - 1) / (R M + S - 1); no GPipe-only rows when 1 is not asked for."""
  out = pipeline_bubble.run(common.MODES["smoke"], (2,), rounds=1, repeats=(2,))
  assert out["rows"] == []
  rows = out["circular_rows"]
  assert [(r["microbatches"], r["repeats"]) for r in rows] == [(2, 2), (4, 2)]
  assert [r["formula_bubble"] for r in rows] == pytest.approx([1 / 5, 1 / 9])
  assert [r["gpipe_formula_bubble"] for r in rows] == pytest.approx([1 / 3, 1 / 5])
  for r in rows:
    assert r["step_s"] > 0 and r["gpipe_step_s"] > 0 and r["reference_step_s"] > 0
    assert math.isclose(r["measured_bubble"], 1 - r["reference_step_s"] / r["step_s"])

"""Every section of `python -m benchmarks.run` runs (issue 37): all of them in one process
at smoke size (benchmarks/common.py's "smoke" mode: tiny configs, one timed step), each
section's JSON checked for what the tables and targets read. A renamed config field or
strategy (`KeyError: 'auto'` in the MoE section) fails here, not in someone's benchmark."""

import pytest

from benchmarks import run as bench_run
from benchmarks import table, targets

pytestmark = pytest.mark.bench_smoke  # Its cost: docs/testing.md, "Tiers".


@pytest.fixture(scope="module")
def results():
  """The smoke run, in this process (8 test devices; the expert-parallel part runs in its
  own subprocess, as in a real run); the suite's compilation cache is kept (smoke mode)."""
  return bench_run.run("smoke", bench_run.SECTIONS)


def test_every_section_runs_and_reports(results):
  assert results["errors"] == {}, {k: v.splitlines()[-1] for k, v in results["errors"].items()}
  assert set(results["section_seconds"]) == set(bench_run.SECTIONS)
  assert {r["dispatch"] for r in results["moe"]["results"]} == {
      "capacity", "dropless", "default", "expert_parallel"}
  assert set(results["train"]["project"]) == {"S", "M", "MoE-S"}
  for name in ("compile", "memory", "decode", "attention"):
    assert results[name], name
  got = {t["name"]: t for t in results["targets"]}
  assert list(got) == list(targets.NAMES)
  assert all(isinstance(t["value"], float) for t in got.values()), [
      n for n, t in got.items() if t["value"] is None]
  text = table.format_results(results)
  assert "section" not in text or "FAILED" not in text
  assert results["device"]["other_processes_cores"] >= 0  # What the busy warning reads.
  train = results["train"]
  s = {t["name"]: t["value"] for t in results["targets"]}
  assert s["train_f32_tokens_per_s_vs_reference_S"] == pytest.approx(
      train["project"]["S"]["float32"]["tokens_per_s"] / train["reference"]["S"]["tokens_per_s"])


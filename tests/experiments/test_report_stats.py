"""Significance in the report: Welch's interval on synthetic seeds, and in every table."""

import json
import random

import pytest

from experiments import report
from experiments.report import stats as report_stats
from tests.experiments.test_report import _write_run


def test_welch_matches_scipy_and_covers_the_true_difference():
  stats = pytest.importorskip("scipy.stats")
  a, b = [2.0, 2.2, 2.1], [2.5, 2.9]
  d, lo, hi, p = report_stats.welch(a, b)
  assert d == pytest.approx(2.1 - 2.7)
  assert p == pytest.approx(stats.ttest_ind(a, b, equal_var=False).pvalue)
  assert lo < d < hi
  # Synthetic seeds with a known difference 0.05 and unequal spreads: the 95% interval
  # holds the truth in ~95% of experiments (a z interval would cover far less at n=3).
  rng = random.Random(0)
  trials, hits = 600, 0
  for _ in range(trials):
    x = [rng.gauss(3.05, 0.02) for _ in range(3)]
    y = [rng.gauss(3.00, 0.04) for _ in range(4)]
    _, lo, hi, _ = report_stats.welch(x, y)
    hits += lo <= 0.05 <= hi
  assert 0.92 <= hits / trials <= 0.98  # +-3.4 sigma of 600 trials.
  assert report_stats.welch([1.0], [1.0, 2.0])[1:] == (None, None, None)  # 1 seed: no CI.


def test_every_table_row_carries_its_difference_to_the_baseline(tmp_path):
  losses = {4: [2.0, 2.1, 2.2], 2: [2.5, 2.9], 1: [3.0]}
  for kv, values in losses.items():
    for seed, loss in enumerate(values):
      _write_run(tmp_path / f"kv{kv}-s{seed}", kv, seed, loss)
  order = [f"kv{kv}-s{s}" for kv, v in losses.items() for s in range(len(v))]
  (tmp_path / "sweep.json").write_text(json.dumps({"points": [{"name": n} for n in order]}))
  paths = report.write_report(str(tmp_path))
  md = open(paths["markdown"]).read()
  d, lo, hi, p = report_stats.welch(losses[2], losses[4])
  header = md.splitlines()[0]
  assert header.startswith("| run | KV heads | loss (nats/token) | Δ loss (nats/token) [95% "
                           "CI] |")
  assert "| bits/byte | Δ bits/byte [95% CI] |" in header and header.endswith("| n |")
  rows = {l.split(" | ")[0][2:]: l for l in md.splitlines()[2:5]}
  assert rows["kv4"].endswith("| 3 |") and "| baseline |" in rows["kv4"]  # The first point.
  # kv2 ran seeds 0, 1, the baseline 0, 1, 2: not the same seeds, so Welch's test.
  assert f"| {d:+.4f} [{lo:+.4f}, {hi:+.4f}] p={p:.2g} |" in rows["kv2"]
  assert rows["kv2"].endswith("| 2† |")  # < 3 seeds: flagged.
  assert f"| {3.0 - 2.1:+.4f} (no CI: n=1) |" in rows["kv1"] and rows["kv1"].endswith("| 1† |")
  assert "fewer than 3 seeds" in md
  tex = open(paths["latex"]).read()
  assert "$\\Delta$ bits/byte" in tex and "2$^\\dagger$" in tex
  assert "nats/token" not in tex  # A page: the headline metric only (--columns for more).
  pytest.importorskip("pandas")
  df = report.load_results(str(tmp_path), groups=True).set_index("label")
  assert df.loc["kv2", "d_final_loss"] == pytest.approx(d)
  assert df.loc["kv2", "p_final_loss"] == pytest.approx(p)
  assert bool(df.loc["kv2", "few_seeds"]) and not df.loc["kv4", "few_seeds"]
  assert df.loc["kv2", "baseline"] == "kv4" and df.loc["kv2", "test_final_loss"] == "welch"


def test_the_same_seeds_are_compared_pair_by_pair():
  """A seed's own noise (data order, shared init) moves both variants alike: paired, the
  difference is clear where Welch's test over the spread of seeds sees nothing."""
  stats = pytest.importorskip("scipy.stats")
  a, b = {0: 2.00, 1: 2.03, 2: 1.97}, {0: 2.02, 1: 2.051, 2: 1.992}
  (d, lo, hi, p), test = report_stats.compare(b, a)
  assert test == "paired" and d == pytest.approx(0.021)
  assert p == pytest.approx(stats.ttest_rel(list(b.values()), list(a.values())).pvalue)
  assert 0 < lo < d < hi and p < 0.01
  assert report_stats.welch(list(b.values()), list(a.values()))[3] > 0.4
  (_, _, _, _), test = report_stats.compare({0: 2.0, 1: 2.1}, a)  # Seeds differ: Welch.
  assert test == "welch"

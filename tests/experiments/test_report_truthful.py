"""The report a paper takes from (issue 28): model figures only in the tables, a run with a
damaged config.json excluded by name, figures ready for a paper column."""

import csv
import json
import os

import pytest

from experiments import report, report_plots
from tests.experiments.test_report import FINAL, _write_run


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
  root = tmp_path_factory.mktemp("gqa")
  for (kv, seed), loss in FINAL.items():
    _write_run(root / f"kv{kv}-s{seed}", kv, seed, loss)
  _write_run(root / "kv1-s0", 1, 0, 1.0)
  (root / "kv1-s0" / "config.json").write_text('{"model": {"num_kv_heads": 1')  # Cut.
  return root


def test_machine_figures_stay_out_of_the_paper_tables(sweep, tmp_path):
  paths = report.write_report(str(sweep), str(tmp_path))
  for kind in ("markdown", "latex"):
    text = open(paths[kind]).read()
    assert "tokens_per_s" not in text.replace("tokens\\_per\\_s", "tokens_per_s"), kind
    assert "mfu" not in text, kind
  with open(paths["results"]) as f:  # Still in results.csv, per run.
    assert {"tokens_per_s", "mfu"} <= set(next(csv.DictReader(f)))


def test_a_run_whose_config_json_is_not_json_is_excluded_by_name(sweep, tmp_path):
  paths = report.write_report(str(sweep), str(tmp_path))
  bad = str(sweep / "kv1-s0" / "config.json")
  assert "kv1-s0" in paths.excluded and bad in paths.excluded["kv1-s0"]
  assert "not valid JSON" in paths.excluded["kv1-s0"]
  assert bad in open(paths["markdown"]).read()  # Said under the table.
  df = report.load_results(str(sweep))  # The notebook path too; the other runs are there.
  assert set(df.run) == {"kv4-s0", "kv4-s1", "kv2-s0", "kv2-s1", "kv1-s0"}
  assert df.set_index("run").loc["kv2-s1", "final_loss"] == FINAL[(2, 1)]


def test_figures_have_readable_labels_no_titles_and_legends_outside(sweep, tmp_path,
                                                                     monkeypatch):
  figures = {}
  real_save = report_plots._save
  def keep(plt, fig, path):
    figures[os.path.basename(path)] = [(a.get_title(), a.get_xlabel(), a.get_ylabel(),
                                        a.get_xlim(), fig.legends) for a in fig.axes][0]
    real_save(plt, fig, path)
  monkeypatch.setattr(report_plots, "_save", keep)
  report.main([str(sweep), "--out", str(tmp_path), "--plot_metric", "bpb"])
  assert set(figures) >= {"eval_loss.png", "final_loss.png"}
  for name, (title, _, ylabel, _, legends) in figures.items():
    assert title == "", name
    assert "bits per byte" in ylabel, name
    for legend in legends:  # Right of the axes, in the figure's margin.
      axes_right = legend.figure.axes[0].get_position().x1
      box = legend.get_window_extent().transformed(legend.figure.transFigure.inverted())
      assert box.x0 >= axes_right, name
  assert figures["final_loss.png"][1] == "KV heads"
  assert figures["eval_loss.png"][3][0] == 0  # The curves' axis starts at step 0.

"""The report a paper takes from (issue 28): model figures only in the tables, a run with a
damaged config.json excluded by name, figures ready for a paper column."""

import csv
import os
from unittest import mock

import pytest

from experiments import report
from experiments.report import style as report_style
from tests.experiments.test_report import FINAL, _write_run


@pytest.fixture(scope="module")
def written(tmp_path_factory):
  """A sweep with one damaged config.json, reported once through the command line with
  bits-per-byte plots; each figure's title, labels, axis range and legends kept."""
  root = tmp_path_factory.mktemp("gqa")
  for (kv, seed), loss in FINAL.items():
    _write_run(root / f"kv{kv}-s{seed}", kv, seed, loss)
  _write_run(root / "kv1-s0", 1, 0, 1.0)
  (root / "kv1-s0" / "config.json").write_text('{"model": {"num_kv_heads": 1')  # Cut.
  figures, real_save = {}, report_style.save

  def keep(plt, fig, path):
    a = fig.axes[0]
    figures[os.path.basename(path)] = (a.get_title(), a.get_xlabel(), a.get_ylabel(),
                                       a.get_xlim(), fig.legends)
    real_save(plt, fig, path)  # Drawn: the legends' positions are final.

  out = root / "report"
  with mock.patch.object(report_style, "save", keep):
    report.main([str(root), "--out", str(out), "--plot_metric", "bpb"])
  return root, out, figures


def test_machine_figures_stay_out_of_the_paper_tables(written):
  _, out, _ = written
  for name in ("table.md", "table.tex"):
    text = (out / name).read_text().replace("\\_", "_")
    assert "tokens_per_s" not in text and "mfu" not in text, name
  with open(out / "results.csv") as f:  # Still in results.csv, per run.
    assert {"tokens_per_s", "mfu"} <= set(next(csv.DictReader(f)))


def test_a_run_whose_config_json_is_not_json_is_excluded_by_name(written):
  root, out, _ = written
  bad = str(root / "kv1-s0" / "config.json")
  with open(out / "results.csv") as f:
    rows = {r["run"]: r for r in csv.DictReader(f)}
  assert bad in rows["kv1-s0"]["excluded"] and "not valid JSON" in rows["kv1-s0"]["excluded"]
  assert bad in (out / "table.md").read_text()  # Said under the table.
  df = report.load_results(str(root))  # The notebook path too; the other runs are there.
  assert set(df.run) == {"kv4-s0", "kv4-s1", "kv2-s0", "kv2-s1", "kv1-s0"}
  assert df.set_index("run").loc["kv2-s1", "final_loss"] == FINAL[(2, 1)]


def test_figures_have_readable_labels_no_titles_and_legends_outside(written):
  figures = written[2]
  assert set(figures) >= {"eval_loss.png", "final_loss.png"}
  for name, (title, _, ylabel, _, legends) in figures.items():
    assert title == "", name
    if name != "attn_logit_max.png":  # The stability figure plots logits, not the metric.
      assert "bits per byte" in ylabel, name
    for legend in legends:  # Right of the axes or below them, in the figure's margin.
      axes = legend.figure.axes[0].get_position()
      box = legend.get_window_extent().transformed(legend.figure.transFigure.inverted())
      assert box.x0 >= axes.x1 or box.y1 <= axes.y0, name
  assert figures["final_loss.png"][1] == "KV heads"
  assert figures["eval_loss.png"][3][0] == 0  # The step axis starts at 0.

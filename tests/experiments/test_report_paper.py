"""Paper outputs: vector PDFs at one column's size, LaTeX escaping, a DataFrame."""

import os

import pytest

from experiments import report
from tests.experiments.test_report import FINAL, _write_run


@pytest.fixture(scope="module")
def root(tmp_path_factory):
  root = tmp_path_factory.mktemp("paper")
  for (kv, seed), final in FINAL.items():
    _write_run(root / f"kv{kv}-s{seed}", kv, seed, final)
  return root


def test_plots_are_pdf_beside_png_at_column_width(root):
  pytest.importorskip("matplotlib")
  from experiments.report import plots as report_plots
  paths = report.write_report(str(root))
  for kind in ("eval_loss", "final_loss", "context_length"):
    png, pdf = paths[f"{kind}_plot"], paths[f"{kind}_pdf"]
    assert pdf == png[:-4] + ".pdf"
    with open(pdf, "rb") as f:
      data = f.read()
    assert data.startswith(b"%PDF") and b"/FontFile2" in data  # Vector, TrueType embedded.
  import matplotlib.image
  height, width = matplotlib.image.imread(paths["final_loss_plot"]).shape[:2]
  # 300 dpi, one column (bbox "tight" trims a little): the paper prints it at 100%.
  assert 0.8 * report_plots.COLUMN_WIDTH * 300 < width <= report_plots.COLUMN_WIDTH * 300 + 20
  assert height < width


@pytest.mark.parametrize("text, tex", [
    ("a_b 50% #1 $x & y", r"a\_b 50\% \#1 \$x \& y"),
    ("{x}~y^2", r"\{x\}\textasciitilde{}y\textasciicircum{}2"),
    ("C:\\runs\\a_b", r"C:\textbackslash{}runs\textbackslash{}a\_b"),
    ("2.1 ± 0.1", r"2.1 $\pm$ 0.1"),
])
def test_latex_escapes_every_special_character(text, tex):
  assert report._tex(text) == tex


def test_load_results_is_a_dataframe_of_results_csv(root):
  pytest.importorskip("pandas")
  df = report.load_results(str(root))
  columns, rows, fields = report.collect(str(root))
  assert list(df.columns) == columns and len(df) == len(rows) == 4
  assert fields == ["model.num_kv_heads"]
  means = df.groupby("model.num_kv_heads").final_loss.mean()
  assert means[4] == pytest.approx(2.1) and means[2] == pytest.approx(2.7)

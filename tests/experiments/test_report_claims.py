"""A paper table never claims what was not measured (issue 37): the issue's sweep (3 seeds
of MHA vs MQA on a two-domain mixture, a held-out corpus in eval.corpora, one run scored
on a harness task and passkey), reported through the command line; every figure's
style checked from the saved matplotlib objects."""

import csv
import json
import os
from unittest import mock

import pytest

from experiments import report
from experiments.report import fits as report_fits, scaling as report_scaling, style as report_style
from tests.experiments.test_report import _write_run

# (kv heads, seed) -> per-domain final bpb: MQA worse by 0.10 on man and 0.02 on legal;
# each seed moves both variants alike (its data order): a paired comparison sees it.
SEED = {0: 0.0, 1: 0.03, 2: -0.02}
BPB = {(kv, s): {"man": 2.0 + SEED[s] + (0.1 if kv == 1 else 0) + 0.002 * s * (kv == 1),
                 "legal": 3.0 + SEED[s] + (0.02 if kv == 1 else 0),
                 "python": 4.0 + SEED[s]} for kv in (4, 1) for s in SEED}


def _scored_run(root, kv, seed):
  run = root / f"kv{kv}-s{seed}"
  _write_run(run, kv, seed, 2.0 + 0.05 * (kv == 1) + SEED[seed])
  record = json.loads((run / "config.json").read_text())
  record["data"].update(corpus="mixture", datasets="man=p/man,legal=p/legal",
                        mixture="man:0.7,legal:0.3")
  record["eval"]["corpora"] = "python=held/*.txt"
  (run / "config.json").write_text(json.dumps(record))
  lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
  lines[-1].update({f"bpb/{d}": v for d, v in BPB[(kv, seed)].items()})
  (run / "metrics.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))
  if (kv, seed) == (4, 1):  # The only run scored: a task-only --mode eval of its checkpoint.
    (run / "evals.jsonl").write_text(json.dumps({
        "step": 10, "split": "eval", "overrides": {"eval.tasks": "unix_mc,passkey"},
        "unix_mc/acc": 0.4167, "passkey/exact": 0.0, "passkey/exact@32/depth0": 0.0,
        "passkey/exact@32/depth100": 1.0, "passkey/exact@64/depth0": 0.0,
        "passkey/exact@64/depth100": 0.0}) + "\n")


@pytest.fixture(scope="module")
def reported(tmp_path_factory):
  pytest.importorskip("matplotlib")
  root = tmp_path_factory.mktemp("mqa")
  for kv, seed in BPB:
    _scored_run(root, kv, seed)
  (root / "sweep.json").write_text(json.dumps({"points": [
      {"name": f"kv{kv}-s{s}"} for kv in (4, 1) for s in SEED]}))
  figures = {}

  def keep(plt, fig, path):
    """Drawn (the layout and the legends' positions are final), kept, not written: the
    files themselves are test_report_paper.py's (rendering them costs seconds)."""
    del plt
    fig.canvas.draw()
    figures[os.path.relpath(path, root)] = fig

  with mock.patch.object(report_style, "save", keep):
    report.main([str(root), "--columns", "final_bpb,bpb/man,bpb/legal,unix_mc/acc"])
    report.main([str(root), "--out", str(root / "default")])
    # compute.png, of a ladder's fits (test_report_fits.py's known law; few replicates).
    from tests.experiments.test_report_fits import _groups  # pylint: disable=g-import-not-at-top
    plt = report_style.pyplot()
    fits = report_fits.fit_all(_groups(), ["model.num_kv_heads", "train.steps"], replicates=5)
    with plt.rc_context(report_style.PAPER_STYLE):
      report_scaling._plot(plt, fits, str(root / "compute.png"))  # pylint: disable=protected-access
  return root, figures


def _rows(text):
  """The main table's rows by label (the domain-interaction table follows a blank line)."""
  table = text.split("\n\n")[0]
  return {l.split(" | ")[0][2:]: l for l in table.splitlines() if l.startswith("| kv")}


def test_a_cell_scored_on_fewer_seeds_says_its_n_and_never_a_std_of_one(reported):
  root, _ = reported
  md = (root / "default" / "table_full.md").read_text()
  rows = _rows(md)
  assert "| 0.4167 (n=1) |" in rows["kv4"] and "| 0.0000 (n=1) |" in rows["kv4"]
  assert rows["kv4"].endswith("| 3 |")  # The row's seeds; the cell says its own.
  assert "0.4167 ±" not in md and "(n=1) ±" not in md
  unscored = [c.strip() for c in rows["kv1"].split("|")]
  header = [c.strip() for c in md.splitlines()[0].split("|")]
  assert unscored[header.index("unix_mc/acc")] == ""  # kv1 was never scored: blank.
  with open(root / "report" / "summary.csv") as f:
    summary = {g["label"]: g for g in csv.DictReader(f)}
  assert summary["kv4"]["unix_mc/acc_n"] == "1" and summary["kv4"]["n"] == "3"
  assert summary["kv4"]["unix_mc/acc_std"] == ""  # No std from one value.
  assert summary["kv1"]["unix_mc/acc_n"] == "0" and summary["kv1"]["d_unix_mc/acc"] == ""
  pytest.importorskip("pandas")
  df = report.load_results(str(root), groups=True).set_index("label")
  assert df.loc["kv4", "passkey/exact_n"] == 1 and df.loc["kv4", "final_bpb_n"] == 3


def test_every_metric_and_the_domain_interaction_carry_their_interval(reported):
  root, _ = reported
  with open(root / "report" / "summary.csv") as f:
    g = {r["label"]: r for r in csv.DictReader(f)}["kv1"]
  for m in ("final_loss", "final_bpb", "bpb/man", "bpb/legal", "bpb/python", "loss@2L"):
    assert g[f"d_{m}"] and g[f"d_{m}_lo"] and g[f"p_{m}"], m
    assert g[f"test_{m}"] == "paired"  # Both rows ran seeds 0, 1, 2.
  assert float(g["d_bpb/man"]) == pytest.approx(0.102)
  assert float(g["d_bpb/man_lo"]) > 0  # The seeds' spread (0.05) cancels pair by pair.
  # MQA's difference is 0.08 smaller on legal than on man: the interaction, with its CI
  # (domains in name order).
  assert float(g["ix_legal_vs_man"]) == pytest.approx(-0.082)
  assert float(g["ix_legal_vs_man_lo"]) < -0.082 < float(g["ix_legal_vs_man_hi"]) < 0
  md = (root / "report" / "table.md").read_text()
  assert "Domain interaction" in md and "| kv1 | bpb/legal − bpb/man | -0.0820 [" in md


def test_tables_take_the_columns_and_tex_defaults_to_a_page(reported, capsys):
  root, _ = reported
  tex = (root / "report" / "table.tex").read_text()
  head = tex.splitlines()[2]
  assert head == ("run & KV heads & bits/byte & $\\Delta$ bits/byte [95\\% CI] & "
                  "man bits/byte & $\\Delta$ man bits/byte [95\\% CI] & legal bits/byte & "
                  "$\\Delta$ legal bits/byte [95\\% CI] & unix\\_mc/acc & $\\Delta$ unix\\_mc/acc "
                  "[95\\% CI] & n \\\\")
  default = (root / "default" / "table.tex").read_text()
  assert default.startswith("\\begin{tabular}{lrrrr}")  # run, KV heads, bits/byte, Δ, n.
  md = (root / "default" / "table.md").read_text()
  assert "| python bits/byte (OOD) |" in md and "| man bits/byte |" in md
  assert "(OOD): an evaluation" in md
  with pytest.raises(SystemExit):
    report.main([str(root), "--out", str(root / "typo"), "--columns", "final_bpb,bpb/mann"])
  assert "error: --columns=final_bpb,bpb/mann: bpb/mann: the report's metric" in \
      capsys.readouterr().err
  assert not (root / "typo").exists()


def test_every_figure_has_no_title_units_and_its_legend_off_the_data(reported):
  _, figures = reported
  names = {os.path.basename(p) for p in figures}
  assert {"eval_loss.png", "final_loss.png", "context_length.png", "domains.png",
          "passkey_by_length.png", "compute.png", "passkey_kv4-s1.png"} <= names
  # A max attention logit (q.k/sqrt(d), dimensionless) is named as what it is.
  units = ("nats/token", "bits per byte", "FLOPs", "tokens", "fraction", "%", "logit")
  for path, fig in figures.items():
    assert fig._suptitle is None, path  # pylint: disable=protected-access
    ax = fig.axes[0]
    assert ax.get_title() == "" and ax.get_xlabel() and "." not in ax.get_xlabel(), path
    assert any(u in ax.get_ylabel() + ax.get_xlabel() for u in units), path
    for legend in fig.legends + [a.get_legend() for a in fig.axes if a.get_legend()]:
      box = legend.get_window_extent()
      for a in fig.axes:  # The data's axes (and a colour bar's).
        assert not box.overlaps(a.get_window_extent()), (path, legend)
  assert figures["report/heatmaps/passkey_kv4-s1.png"].axes[0].get_ylabel().startswith(
      "needle depth")
  domains = figures["report/domains.png"].axes[0]
  assert [t.get_text() for t in domains.get_xticklabels()] == ["legal", "man", "python (OOD)"]

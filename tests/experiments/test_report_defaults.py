"""What a reviewer sees by default (issue 46 items 4, 6, 8): a RoPE ablation on a
two-domain mixture with a held-out corpus, its zero-shot YaRN evaluation points, and
passkey at chance for every variant; reported through `python -m experiments.report`,
each figure checked from the saved matplotlib objects."""

import json
import os
from unittest import mock

import pytest

from experiments import report
from experiments.report import style as report_style
from tests.experiments.test_report import _write_run

SEEDS = (0, 1)
# point -> (pos encoding, eval.rope_scaling, eval.rope_scaling_factor, eval-only point)
POINTS = {"rope": ("rope", "", 0.0, False), "alibi": ("alibi", "", 0.0, False),
          "rope-yarn": ("rope", "yarn", 8.0, True)}


def _point(root, name, seed):
  pos, scaling, factor, eval_only = POINTS[name]
  run = root / f"{name}-s{seed}"
  _write_run(run, 4, seed, 2.0 + 0.1 * seed + 0.2 * (pos == "alibi"))
  record = json.loads((run / "config.json").read_text())
  record["model"]["pos_encoding"] = pos
  record["eval"].update(rope_scaling=scaling, rope_scaling_factor=factor,
                        corpora="rst=held/*.rst")
  record["data"].update(corpus="mixture", datasets="deb=p/deb,locale=p/locale",
                        mixture="deb:0.6,locale:0.4")
  (run / "config.json").write_text(json.dumps(record))
  lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
  L = record["data"]["seq_len"]
  lines[-1].update({"bpb/deb": 1.0 + 0.01 * seed, "bpb/locale": 2.0 + 0.03 * seed * (
      pos == "alibi"), "bpb/rst": 3.0 + 0.02 * seed, "passkey/exact": 0.0,
      f"passkey/exact@{2 * L}": 0.0, f"passkey/exact@{4 * L}": 0.0})
  if eval_only:  # An evaluation point: one eval line at the trained run's final step.
    lines = [lines[-1]]
  (run / "metrics.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))


@pytest.fixture(scope="module")
def reported(tmp_path_factory):
  pytest.importorskip("matplotlib")
  root = tmp_path_factory.mktemp("rope")
  for name in POINTS:
    for s in SEEDS:
      _point(root, name, s)
  (root / "sweep.json").write_text(json.dumps({"points": [
      {"name": f"{n}-s{s}"} for n in POINTS for s in SEEDS]}))
  figures = {}

  def keep(plt, fig, path):
    del plt
    fig.canvas.draw()
    figures[os.path.basename(path)] = fig

  with mock.patch.object(report_style, "save", keep):
    written = report.write_report(str(root))
  return root, written, figures


def _table(path):
  lines = open(path).read().split("\n\n")[0].splitlines()
  head = [c.strip() for c in lines[0].strip("|").split("|")]
  return head, {l.split(" | ")[0][2:]: [c.strip() for c in l.strip("|").split("|")]
                for l in lines[2:]}


def test_table_md_is_narrow_readable_and_blank_where_a_field_does_not_apply(reported):
  _, written, _ = reported
  head, rows = _table(written["markdown"])
  assert head[:4] == ["run", "zero-shot RoPE scaling", "zero-shot scaling factor",
                      "positional encoding"]  # KV heads: not swept, not shown.
  assert "zero-shot scaling factor" in head and "bits/byte" in head
  assert "loss (nats/token)" in head and "rst bits/byte (OOD)" in head
  factor = head.index("zero-shot scaling factor")
  assert rows["rope"][factor] == "-" and rows["rope-yarn"][factor] == "8.0"
  assert rows["rope"][head.index("zero-shot RoPE scaling")] == "-"
  for wide in ("tokens", "training FLOPs", "params", "accuracy", "passkey/exact"):
    assert wide not in head, wide
  full, _ = _table(written["markdown_full"])
  assert {"params", "accuracy", "KV bytes/token", "passkey/exact"} <= set(full)
  assert len(head) == 15 < len(full)  # run, 3 fields, 5 metrics with their Δ, n.


def test_table_tex_headlines_bits_per_byte_and_the_interaction_marks_the_ood_corpus(
    reported):
  _, written, _ = reported
  tex = open(written["latex"]).read()
  assert tex.splitlines()[2].startswith(
      "run & zero-shot RoPE scaling & zero-shot scaling factor & positional encoding & "
      "bits/byte & $\\Delta$ bits/byte")
  assert "nats/token" not in tex.split("\\end{tabular}")[0]
  md = open(written["markdown"]).read()
  assert "| alibi | bpb/deb − bpb/rst (OOD) |" in md, md


def test_passkey_at_chance_for_every_variant_is_said_and_its_lines_stay_apart(reported):
  _, written, figures = reported
  for kind in ("markdown", "markdown_full"):
    text = open(written[kind]).read()
    assert "**Warning**: passkey: exact match is 0.00 at every length for every variant" in text
    assert "The passkey recipe" in text
  assert "% Warning: passkey: exact match is 0.00" in open(written["latex"]).read()
  assert "warning: passkey: exact match is 0.00" in written.notes
  ax = figures["passkey_by_length.png"].axes[0]
  lines = [c.lines[0] for c in ax.containers]  # Each errorbar's data line.
  assert len(lines) == len(POINTS)
  assert len({(l.get_marker(), l.get_linestyle()) for l in lines}) == len(POINTS)
  assert len({tuple(l.get_xdata()) for l in lines}) == len(POINTS)  # Shifted apart.
  assert ax.get_xlabel() == "context length (tokens; L = 32 tokens)"


def test_eval_points_are_drawn_as_their_legend_shows_and_l_is_in_tokens(reported):
  _, _, figures = reported
  ax = figures["eval_loss.png"].axes[0]
  legend = figures["eval_loss.png"].legends[0]
  handles = dict(zip([t.get_text() for t in legend.get_texts()], legend.legend_handles))
  for line in ax.get_lines():
    if line.get_label() in handles:
      h = handles[line.get_label()]
      assert (h.get_marker(), h.get_linestyle()) == (line.get_marker(), line.get_linestyle())
  yarn = handles["rope-yarn"]
  assert yarn.get_linestyle() == "None" and yarn.get_marker() not in (".", "None")
  assert handles["rope"].get_linestyle() == "-"
  ctx = figures["context_length.png"].axes[0]
  assert ctx.get_xlabel() == "eval context length (tokens; L = 32 tokens)"

"""The report's evaluation-task columns (harness and retrieval) and their plots, from
run directories written the way training and evaluation points write them."""

import json
import os

import pytest

from experiments import report
from experiments.configs import base


def _run(root, name, pos, seed, exact_2l):
  d = os.path.join(root, name)
  os.makedirs(d)
  c = base.get_config("smoke")
  c.model.pos_encoding, c.train.seed = pos, seed
  with open(os.path.join(d, "config.json"), "w") as f:
    json.dump(c.to_dict(), f, default=list)
  line = {"step": c.train.steps, "split": "eval", "loss": 2.0 + seed, "bpb": 3.0,
          "accuracy": 0.3, "hellaswag/acc": 0.25 + 0.01 * seed, "hellaswag/acc_stderr": 0.01,
          "hellaswag/n": 100.0, "passkey/exact": 1.0, "passkey/exact@64": exact_2l,
          "passkey/rank@64": 2.0, "passkey/exact@32/depth0": 1.0,
          "passkey/exact@32/depth100": 1.0, "passkey/exact@64/depth0": exact_2l,
          "passkey/exact@64/depth100": 0.0}
  with open(os.path.join(d, "metrics.jsonl"), "w") as f:
    f.write(json.dumps(line) + "\n")
  # --mode eval records: one with task fields only (reported), one under another model.
  for overrides, acc in (({"eval.tasks": "piqa", "eval.num_fewshot": 0}, 0.6 + 0.1 * seed),
                         ({"eval.tasks": "piqa", "eval.rope_scaling": "yarn"}, 0.0)):
    with open(os.path.join(d, "evals.jsonl"), "a") as f:
      f.write(json.dumps({"step": c.train.steps, "split": "eval", "overrides": overrides,
                          "piqa/acc": acc}) + "\n")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
  root = str(tmp_path_factory.mktemp("report_tasks"))
  for s in (0, 1):  # Three runs: each heat-map costs a PNG and a PDF.
    _run(root, f"rope-s{s}", "rope", s, 0.5 * s)
  _run(root, "alibi-s0", "alibi", 0, 1.0)
  return root, report.write_report(root)


def test_task_columns_sit_beside_the_loss_as_mean_std_over_seeds(written):
  root, paths = written
  columns, _, _ = report.collect(root)
  assert columns.index("final_loss") < columns.index("hellaswag/acc") < columns.index(
      "passkey/exact") < columns.index("passkey/exact@2L") < columns.index("passkey/rank@2L")
  assert not [c for c in columns if "depth" in c or c.endswith(("_stderr", "/n"))]
  table = open(paths["markdown_full"]).read()
  header = table.splitlines()[0]
  assert "hellaswag/acc" in header and "passkey/exact@2L" in header
  rope = next(l for l in table.splitlines() if l.startswith("| rope "))
  assert "0.2550 ± 0.0071" in rope and "0.2500 ± 0.3536" in rope and rope.endswith("| 2† |")  # † : under 3 seeds
  assert "piqa/acc" in header and "0.6500 ± 0.0707" in rope  # evals.jsonl, task fields only.


def test_retrieval_plots_are_written_as_png_and_pdf(written):
  _, paths = written
  for kind in ("passkey_by_length", "passkey_heatmap_rope-s0", "passkey_heatmap_alibi-s0"):
    for ext in ("plot", "pdf"):
      assert os.path.getsize(paths[f"{kind}_{ext}"]) > 1000, kind

"""The report on hand-written run directories: csv columns, mean ± std over seeds, files."""

import csv
import json
import os
import statistics

import pytest

from experiments import report
from experiments.configs import base

FINAL = {(4, 0): 2.0, (4, 1): 2.2, (2, 0): 2.5, (2, 1): 2.9}  # (kv heads, seed) -> loss.
ORDER = ["kv4-s0", "kv4-s1", "kv2-s0", "kv2-s1", "kv1-s0", "kv8-s0"]  # The sweep's order.


def _write_run(run_dir, kv, seed, final, *, steps=10, moe=False, finished=True):
  c = base.get_config("smoke")
  c.model.num_kv_heads, c.train.seed, c.train.steps = kv, seed, steps
  c.eval.context_lengths = (1, 2)
  os.makedirs(run_dir)
  with open(os.path.join(run_dir, "config.json"), "w") as f:
    json.dump({**c.to_dict(), "_run": {"git_commit": "x"}}, f)
  L = c.data.seq_len
  lines = [{"step": 5, "split": "train", "loss": 3.0, "tokens_per_s": 100.0 * kv, "mfu": 0.1},
           {"step": 5, "split": "eval", "loss": final - 0.5 if seed else final + 0.5,
            "bpb": 4.0, "ppl": 1.0, "accuracy": 0.1, f"loss@{2 * L}": 9.0, f"bpb@{2 * L}": 9.5}]
  if finished:
    lines += [{"step": 10, "split": "train", "loss": 2.0, "tokens_per_s": 300.0 * kv,
               "mfu": 0.3, **({"moe_maxvio": 0.7} if moe else {})},
              {"step": 10, "split": "eval", "loss": final, "bpb": final / 2, "ppl": 1.0,
               "accuracy": 0.5, f"loss@{2 * L}": final + 1, f"bpb@{2 * L}": final,
               **({"moe_maxvio_global": 0.25} if moe else {})}]
  with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in lines)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
  root = tmp_path_factory.mktemp("gqa")
  for (kv, seed), loss in FINAL.items():
    _write_run(root / f"kv{kv}-s{seed}", kv, seed, loss)
  _write_run(root / "kv1-s0", 1, 0, 1.0, finished=False)  # Still running: csv only.
  (root / "kv8-s0").mkdir()  # A sweep point that failed before writing its config.
  (root / "kv8-s0" / "FAILED").write_text("Traceback ...")
  (root / "sweep.json").write_text(json.dumps({"points": [{"name": n} for n in ORDER]}))
  return root, report.write_report(str(root))


def _rows(path):
  with open(path) as f:
    return list(csv.DictReader(f))


def test_results_csv_has_one_row_per_run_with_the_metrics(written):
  root, paths = written
  rows = {r["run"]: r for r in _rows(paths["results"])}
  assert list(rows) == ORDER  # sweep.json's order.
  assert rows["kv8-s0"]["status"] == "failed" and rows["kv8-s0"]["final_loss"] == ""
  cols = list(next(iter(rows.values())))
  assert cols[:3] == ["run", "model.num_kv_heads", "seed"]  # Only the swept field varies.
  for c in ("final_loss", "best_loss", "final_bpb", "tokens_per_s", "params",
            "kv_bytes_per_token", "loss@2L", "bpb@2L"):
    assert c in cols
  assert "moe_maxvio" not in cols  # No MoE run here.
  r = rows["kv4-s1"]
  assert float(r["final_loss"]) == 2.2 and float(r["best_loss"]) == pytest.approx(1.7)  # min
  assert float(r["loss@2L"]) == 3.2 and float(r["tokens_per_s"]) == 800.0  # median
  assert rows["kv1-s0"]["status"] == "unfinished" and r["status"] == "finished"
  # KV bytes per token = 2 (k, v) * layers * K * head_dim * 4 (float32), head_dim = 32 / 4.
  assert int(rows["kv2-s0"]["kv_bytes_per_token"]) == 2 * 2 * 2 * 8 * 4
  # Parameters: each KV head removed drops its k and v projections in every layer.
  diff = int(rows["kv4-s0"]["params"]) - int(rows["kv2-s0"]["params"])
  assert diff == 2 * 2 * 32 * 8 * 2


def test_groups_over_seeds_with_mean_std_and_n(written):
  root, paths = written
  groups = {g["label"]: g for g in _rows(paths["summary"])}
  assert list(groups) == ["kv4", "kv2"]  # Unfinished and failed runs are not averaged.
  for kv in (2, 4):
    losses = [FINAL[(kv, s)] for s in (0, 1)]
    g = groups[f"kv{kv}"]
    assert int(g["n"]) == 2
    assert float(g["final_loss_mean"]) == pytest.approx(statistics.fmean(losses))
    assert float(g["final_loss_std"]) == pytest.approx(statistics.stdev(losses))
  with open(paths["markdown"]) as f:
    md = f.read()
  assert "| kv4 | 4 | 2.1000 ± 0.1414 |" in md and md.splitlines()[0].endswith("| n |")
  with open(paths["latex"]) as f:
    tex = f.read()
  assert "kv4 & 4 & 2.1000 $\\pm$ 0.1414" in tex and "final\\_loss" in tex
  assert tex.startswith("\\begin{tabular}") and "\\bottomrule" in tex


def test_plots_and_moe_columns(written, tmp_path):
  pytest.importorskip("matplotlib")
  _, paths = written
  for kind in ("eval_loss_plot", "final_loss_plot", "context_length_plot"):
    assert os.path.getsize(paths[kind]) > 1000
  _write_run(tmp_path / "moe-s0", 2, 0, 2.0, moe=True)
  columns, rows, fields = report.collect(str(tmp_path))
  assert fields == [] and "moe_maxvio" in columns and rows[0]["moe_maxvio"] == 0.25
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(FileNotFoundError, match="no run directories"):
    report.collect(str(empty))

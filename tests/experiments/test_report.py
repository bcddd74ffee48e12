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
  logits = {f"telemetry/attn_logit_max/L{i}": 2.0 + i + kv for i in range(2)}  # Per layer.
  lines = [{"step": 5, "split": "train", "loss": 3.0, "tokens_per_s": 100.0 * kv, "mfu": 0.1,
            **logits},
           {"step": 5, "split": "eval", "loss": final - 0.5 if seed else final + 0.5,
            "bpb": 4.0, "ppl": 1.0, "accuracy": 0.1, f"loss@{2 * L}": 9.0, f"bpb@{2 * L}": 9.5}]
  if finished:
    lines += [{"step": 10, "split": "train", "loss": 2.0, "tokens_per_s": 300.0 * kv,
               "mfu": 0.3, **({"moe_maxvio": 0.7} if moe else {}), **logits},
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
  assert "kv4 & 4 & 1.0500 $\\pm$ 0.0707" in tex and "bits/byte" in tex  # The headline.
  assert tex.startswith("\\begin{tabular}") and "\\bottomrule" in tex


def test_plots_and_moe_columns(written, tmp_path):
  pytest.importorskip("matplotlib")
  _, paths = written
  for kind in ("eval_loss_plot", "final_loss_plot", "context_length_plot",
               "attn_logit_max_plot"):  # The last: one panel per run, a line per layer.
    assert os.path.getsize(paths[kind]) > 1000
  from experiments.report.telemetry import logit_series  # pylint: disable=g-import-not-at-top
  assert logit_series(str(written[0] / "kv2-s0")) == {0: ([5, 10], [4.0, 4.0]),
                                                      1: ([5, 10], [5.0, 5.0])}
  _write_run(tmp_path / "moe-s0", 2, 0, 2.0, moe=True)
  columns, rows, fields = report.collect(str(tmp_path))
  assert fields == [] and "moe_maxvio" in columns and rows[0]["moe_maxvio"] == 0.25
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(FileNotFoundError, match="no run directories"):
    report.collect(str(empty))


def _cut_last_line(run_dir):
  """A crash mid-write: metrics.jsonl's last line is cut in half."""
  path = os.path.join(run_dir, "metrics.jsonl")
  with open(path) as f:
    text = f.read().rstrip("\n")
  last = text.rsplit("\n", 1)[-1]
  with open(path, "w") as f:
    f.write(text[:len(text) - len(last) // 2])


def _add_eval(run_dir, **metrics):
  """One more eval line, in step order."""
  path = os.path.join(run_dir, "metrics.jsonl")
  with open(path) as f:
    records = [json.loads(line) for line in f] + [{"split": "eval", **metrics}]
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in sorted(records, key=lambda r: r["step"]))


def test_every_run_left_out_of_the_tables_is_named_with_its_reason(tmp_path, capsys):
  _write_run(tmp_path / "done", 4, 0, 2.0)
  _write_run(tmp_path / "half", 4, 0, 2.0, finished=False)
  _write_run(tmp_path / "crashed", 4, 0, 2.0, finished=False)
  (tmp_path / "crashed" / "FAILED").write_text(
      "Traceback (most recent call last):\n  File \"x.py\", line 1\nValueError: boom\n")
  _write_run(tmp_path / "cut", 4, 0, 2.0)
  _cut_last_line(tmp_path / "cut")  # Its final eval line.
  reasons = {
      "half": "unfinished: last logged step 5 of 10",
      "crashed": "failed: ValueError: boom",
      "cut": "no eval line at the final step 10 (metrics.jsonl's last line was cut: "
             "re-run the same command to log it)",
  }
  paths = report.write_report(str(tmp_path))
  assert paths.excluded == reasons
  groups = _rows(paths["summary"])
  assert len(groups) == 1 and groups[0]["n"] == "1"  # Only "done" is averaged.
  rows = {r["run"]: r for r in _rows(paths["results"])}
  assert {n: rows[n]["excluded"] for n in rows} == {"done": "", **reasons}
  with open(paths["markdown"]) as f:
    md = f.read()
  assert "Excluded runs, not in the grouped tables (3 of 4 runs)" in md
  with open(paths["latex"]) as f:
    tex = f.read()
  report.main([str(tmp_path), "--out", str(tmp_path / "again")])
  printed = capsys.readouterr().out
  for name, why in reasons.items():
    assert f"- `{name}`: {why}\n" in md
    assert f"%   {name}: {why}\n" in tex
    assert f"  {name}: {why}\n" in printed


def test_non_finite_metrics_are_skipped_not_crashed_on(tmp_path):
  _write_run(tmp_path / "spike-s0", 4, 0, 2.0)
  _add_eval(tmp_path / "spike-s0", step=7, loss=None, bpb=None)  # Logged as null.
  _write_run(tmp_path / "diverged-s0", 2, 0, 2.0, finished=False)
  _add_eval(tmp_path / "diverged-s0", step=10, loss=None, bpb=None, accuracy=0.0)
  _write_run(tmp_path / "old-s0", 1, 0, 2.5)
  _add_eval(tmp_path / "old-s0", step=8, loss="nan")  # Older writers: the string "nan".
  paths = report.write_report(str(tmp_path))
  assert paths.excluded == {"diverged-s0": "non-finite final loss (null at step 10)"}
  rows = {r["run"]: r for r in _rows(paths["results"])}
  assert float(rows["spike-s0"]["best_loss"]) == 2.0  # min(2.5, null, 2.0): null skipped.
  assert float(rows["old-s0"]["final_loss"]) == 2.5
  assert rows["diverged-s0"]["final_loss"] == "" and rows["diverged-s0"]["best_loss"] != ""
  with open(paths["markdown"]) as f:
    md = f.read()
  assert "nan" not in md.lower()
  assert {g["label"] for g in _rows(paths["summary"])} == {"spike", "old"}
  assert "- `spike-s0`: bpb, loss at step 7\n" in md and "- `old-s0`: loss at step 8\n" in md


def test_config_changes_mid_run_are_shown(tmp_path):
  from train.lifecycle.changes import record_changes  # pylint: disable=g-import-not-at-top
  for kv in (4, 2):
    _write_run(tmp_path / f"kv{kv}-s0", kv, 0, 2.0)
  record_changes(str(tmp_path / "kv2-s0"), 5, [
      {"field": "train.lr", "old": 0.003, "new": 0.001},
      {"field": "train.steps", "old": 5, "new": 10}])
  paths = report.write_report(str(tmp_path))
  rows = {r["run"]: r for r in _rows(paths["results"])}
  change = "train.lr 0.003->0.001 @5; train.steps 5->10 @5"
  assert rows["kv2-s0"]["config_changes"] == change and rows["kv4-s0"]["config_changes"] == ""
  with open(paths["markdown"]) as f:
    md = f.read()
  assert "| kv2 | 2 |" in md  # Still in the table, with a warning under it.
  assert "Config changed mid-run" in md and f"- `kv2-s0`: {change}\n" in md
  assert paths.excluded == {}

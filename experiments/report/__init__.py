"""Run directories -> tables (csv, markdown, LaTeX) and plots.

    python -m experiments.report runs/gqa            # -> runs/gqa/report/
    python -m experiments.report runs/gqa --out DIR
    python -m experiments.report runs/gqa --columns final_bpb,bpb/man,unix_mc/acc

Every directory under the root holding a config.json is a run. Writes:
  results.csv   one row per run: the swept fields (config paths whose values differ
                between runs, e.g. `model.num_kv_heads`), `seed`, final and best eval
                loss and bits per byte, accuracy, tokens and training FLOPs (`flops`),
                median tokens/s and MFU, parameters, KV-cache bytes per token, MoE
                MaxVio, `loss@2L`... (longer contexts), `excluded` (why a run is not in
                the groups) and `config_changes` ("train.lr 0.003->0.001 @200; ...")
  summary.csv   finished runs grouped over seeds: n, each metric's _mean, _std and _n
                (the seeds that measured it), its difference to the baseline with its
                95% CI, p and test, and the domains' interactions (stats.py)
  table.md, table.tex   the same groups: each metric as mean ± std, `(n=k)` when fewer
                seeds than the row's measured it, and its Δ [95% CI] (fewer than 3
                seeds flagged †); readable headers ("KV heads", "bits/byte"), "-" for a
                field that does not apply (a scaling factor on an unscaled row);
                `--columns` picks the metrics (default: table.md the swept fields and
                the headline metrics, loss, bits per byte and each corpus's bits per
                byte; table_full.md every model metric; table.tex bits per byte, or
                the loss where none was measured: tables.py); then notes
                (LaTeX comments in table.tex): excluded runs with their reasons,
                config changes mid-run, non-finite (null) metrics, and a warning
                where an evaluation measured nothing (passkey exact match 0 at every
                length of every variant: tasks.at_chance); the command prints the same
  lr.md, fits.md, compute.png ...   with an lr grid, each variant at its best lr; for
                a ladder, loss-vs-compute fits and compute multipliers (scaling.py)
  interaction.md  a sweep of model.quantization x one other field: each level's Δ(scheme -
                none) and its difference to the first level's, 95% CIs (interaction.py)
  goodput.md, goodput.csv   per run with a goodput ledger (RUN/goodput.jsonl): goodput
                (productive / wall time) and where the wall time went (goodput.py)
  *.png, *.pdf  eval loss vs step, final loss per swept value, loss vs context length,
                bits per byte per domain, retrieval; PNG and vector PDF for one paper
                column (plots.py, in style.py's style; matplotlib)

In a notebook, `load_results(root)` is results.csv as a pandas DataFrame.
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import tempfile

from experiments.report import goodput, interaction, notes as report_notes, plots, scaling
from experiments.report import tables
from experiments.report import tasks as report_tasks
# Grouping over seeds (summary.csv, the tables) lives in groups.py and reading the runs
# in runs.py; both re-exported here (`report.collect`, `report.load_results`, ...).
from experiments.report.groups import (  # pylint: disable=unused-import
    group_rows, summary_columns, table_fields)
from experiments.report.runs import (  # pylint: disable=unused-import
    DOMAIN_PREFIX, METRICS, _model_sizes, collect, find_runs, load_results, summarize_run,
    swept_fields, tokens_spent)
from train.io import staging, storage

log = logging.getLogger(__name__)
_tex = tables.tex  # LaTeX escaping, for the other tables (scaling.py).


# Writing ---------------------------------------------------------------------


def _write_csv(path: str, columns: list[str], rows: list[dict]) -> None:
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, columns, extrasaction="ignore")
    writer.writeheader()
    for r in rows:
      writer.writerow({c: "" if r.get(c) is None else r[c] for c in columns})


class Report(dict):
  """{kind: path} of the files written; `excluded` is {run: why it is not in the grouped
  tables} and `notes` the text under the tables ("" when every run is in them)."""

  def __init__(self, paths: dict[str, str], excluded: dict[str, str], notes: str):
    super().__init__(paths)
    self.excluded, self.notes = excluded, notes


def _ood(rows: list[dict]) -> frozenset:
  """The bpb/<name> columns of evaluation corpora (eval.corpora) outside the training data
  (a mixture's domains are evaluated under their names too, and may not be named there)."""
  return frozenset(f"{DOMAIN_PREFIX}{n}" for r in rows for n in r.get("_eval_corpora", ()))


def write_report(root: str, out: str | None = None, plot_metric: str = "loss",
                 columns: str | None = None) -> Report:
  """Writes the report for every run under `root`; returns {kind: path} (a Report).
  `plot_metric`: what the plots show, "loss" or "bpb" (bits per byte). `columns`: the
  tables' metric columns, "final_bpb,bpb/man" (default: tables.py's).

  `root` and `out` may be bucket URLs (train/io/storage.py): an output on a bucket is
  written in a local temporary directory, then each file uploaded once."""
  out = out or storage.join(root, "report")
  if not storage.is_url(out):
    return _write_report(root, out, plot_metric, columns)
  with tempfile.TemporaryDirectory(prefix="report-") as local:
    report = _write_report(root, local, plot_metric, columns)
    staging.upload_dir(local, out)
  return Report({k: storage.join(out, *os.path.relpath(p, local).split(os.sep))
                 for k, p in report.items()}, report.excluded, report.notes)


def _write_report(root: str, out: str, plot_metric: str, columns: str | None) -> Report:
  all_columns, rows, fields = collect(root)
  metrics = [c for c in all_columns[all_columns.index("step") + 1:]
             if c not in report_notes.COLUMNS]
  # The tables keep to the headline figures of the model; the csv files hold every metric,
  # machine figures (tokens/s, MFU: the hardware and its load, not the model) included.
  shown = [m for m in metrics if m not in ("best_bpb", "tokens_per_s", "mfu", "active_params")
           and not m.startswith(("bpb@", "accuracy@"))]
  tables.select(columns, metrics, shown)  # Refused before any write.
  groups = group_rows(rows, fields, metrics)
  # table.md: the swept fields and the headline metrics (loss, bits per byte, each
  # corpus's); table_full.md every model metric; table.tex bits per byte (or the loss).
  md_columns = tables.select(columns, metrics, tables.narrow(metrics, groups))
  tex_columns = tables.select(columns, metrics, tables.headline(metrics, groups))
  os.makedirs(out, exist_ok=True)
  paths = {k: os.path.join(out, f) for k, f in (
      ("results", "results.csv"), ("summary", "summary.csv"), ("markdown", "table.md"),
      ("markdown_full", "table_full.md"), ("latex", "table.tex"))}
  _write_csv(paths["results"], all_columns, rows)
  _write_csv(paths["summary"], summary_columns(fields, metrics), groups)
  # What the tables leave out or cannot show is said under them, never dropped silently.
  notes, ood, shown_fields = report_notes.collect_notes(rows), _ood(rows), table_fields(fields)
  warnings = report_tasks.at_chance(groups)  # An evaluation that measured nothing.
  for w in warnings:
    log.warning("%s", w)
  md_notes = report_notes.markdown_notes(notes, len(rows)) + "".join(
      f"\n**Warning**: {w}\n" for w in warnings)
  with open(paths["markdown"], "w") as f:
    f.write(tables.markdown(groups, shown_fields, md_columns, ood) + md_notes)
  with open(paths["markdown_full"], "w") as f:
    f.write(tables.markdown(groups, shown_fields, tables.select(columns, metrics, shown), ood)
            + md_notes)
  with open(paths["latex"], "w") as f:
    f.write(tables.latex(groups, shown_fields, tex_columns, ood) +
            report_notes.latex_notes(notes, len(rows)) +
            "".join(f"% Warning: {w}\n" for w in warnings))
  paths.update(plots.plot_all(root, out, rows, groups, fields, plot_metric, ood))
  scaling_paths, scaling_text = scaling.write(out, groups, fields, _tex, rows)  # lr, fits
  paths.update(scaling_paths)
  paths.update(goodput.write(root, out, [r["run"] for r in rows]))  # Runs with a ledger.
  paths.update(interaction.write(out, groups, fields))  # quantization x attention.
  text = report_notes.text_notes(notes, len(rows)) + "".join(
      f"warning: {w}\n" for w in warnings)
  return Report(paths, {r["run"]: r["excluded"] for r in rows if r.get("excluded")},
                text + (scaling_text + "\n" if scaling_text else ""))


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m experiments.report", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("root", help="a sweep directory (or one run directory)")
  parser.add_argument("--out", default=None, help="output directory (default: ROOT/report)")
  parser.add_argument("--plot_metric", choices=("loss", "bpb"), default="loss",
                      help="what the plots show: eval loss or bits per byte")
  parser.add_argument("--columns", default=None,
                      help="the tables' metric columns, e.g. final_bpb,bpb/man,unix_mc/acc "
                           "(default: every model metric in table.md, the headline metric "
                           "in table.tex; summary.csv always holds all)")
  args = parser.parse_args(argv)
  try:
    report = write_report(args.root, args.out, args.plot_metric, args.columns)
  except (ValueError, OSError) as e:
    parser.exit(1, f"error: {e}\n")
  for kind, path in report.items():
    print(f"{kind:<10} {path}")
  if report.notes:
    print("\n" + report.notes, end="")

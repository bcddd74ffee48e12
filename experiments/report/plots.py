"""The report's plots (matplotlib, Agg backend; skipped when it is not installed).

  eval_loss.png       eval loss vs step, one line per run, one colour per group
  final_loss.png      final eval loss per group (x = the swept value when a
                      single field is swept), mean ± std over seeds, runs as dots
  context_length.png  eval loss vs context length (multiples of the training
                      length L), one line per group: the length-extrapolation plot
  domains.png         final bits per byte per domain (each bpb/<name>: a mixture's
                      domains, eval.corpora marked OOD), one series per group, mean ±
                      std over seeds
  (tasks.py: passkey_by_length, heatmaps/; scaling.py: compute.png;
  telemetry.py: attn_logit_max.png, the per-layer max attention logit over steps,
  one panel per sweep point)

The style, for every figure of the report: no titles (the paper's captions say what
they show); axis labels are readable names with units ("KV heads", not
`model.num_kv_heads`: `READABLE`; "eval loss (nats/token)", "eval bits per byte",
"training FLOPs", "context length (tokens)"); legends sit outside the data, right of
the axes or, for final_loss's two entries, below them (style.py); the step
axis starts at 0 (with `eval.at_start=True` runs log the untrained model's eval there), and
`metric="bpb"` plots bits per byte (comparable across tokenizers) instead of loss.
Each is also written as a vector PDF beside the PNG, sized and set for one column
of a two-column paper (3.3 in wide, 8 pt text, fonts embedded as TrueType), so
`includegraphics{final_loss.pdf}` needs no scaling and its text matches a caption.
"""

from __future__ import annotations

import logging
import os

from experiments.report.notes import at_length, finite
# The style lives in style.py (tasks.py and scaling.py draw with it too).
from experiments.report import style as report_style
from experiments.report import tasks as report_tasks, telemetry as report_telemetry
from experiments.report.style import (  # pylint: disable=unused-import
    COLUMN_WIDTH, METRIC_NAMES, PAPER_STYLE, READABLE, readable)
from train.io import storage
from train.metrics import read_metrics

log = logging.getLogger(__name__)


def _group_of(rows, groups, fields):
  """Row index -> group index (runs that share every swept value)."""
  keys = [tuple(str(g[f]) for f in fields) for g in groups]
  return {i: keys.index(tuple(str(r[f]) for f in fields))
          for i, r in enumerate(rows) if tuple(str(r[f]) for f in fields) in keys}


def _eval_loss(plt, root, rows, groups, fields, path, metric="loss"):
  fig, ax = report_style.figure(plt)
  colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  member = _group_of(rows, groups, fields)
  labelled = set()
  for i, r in enumerate(rows):
    evals = [m for m in read_metrics(storage.join(root, r["run"]), warn=False)
             if m.get("split") == "eval" and finite(m.get(metric)) is not None]
    if not evals:
      continue
    g = member.get(i)
    label = groups[g]["label"] if g is not None and g not in labelled else None
    labelled.add(g)
    # One eval point (an evaluation-only point: zero-shot YaRN of a trained run) is a
    # marker without a line, in the legend too; a curve is a line with small dots.
    style = ({"marker": "D", "linestyle": "none", "markersize": 4} if len(evals) == 1
             else {"marker": ".", "linestyle": "-"})
    ax.plot([m["step"] for m in evals], [m[metric] for m in evals], label=label, alpha=0.8,
            color=colours[(g if g is not None else i) % len(colours)], **style)
  ax.set(xlabel="training step", ylabel=METRIC_NAMES[metric])
  ax.set_xlim(left=0)  # From step 0, as training starts.
  ax.grid(alpha=0.3)
  report_style.legend(ax)
  report_style.save(plt, fig, path)


def _numeric(values) -> bool:
  return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def _final_loss(plt, rows, groups, fields, path, metric="loss"):
  key = f"final_{metric}"
  groups = [g for g in groups if g.get(f"{key}_mean") is not None]
  # Many groups: the full width of both columns (a figure* environment), else one column.
  fig, ax = report_style.figure(plt, COLUMN_WIDTH * (1 if len(groups) <= 6 else 2.1))
  single = len(fields) == 1 and _numeric([g[fields[0]] for g in groups])
  xs = [g[fields[0]] for g in groups] if single else list(range(len(groups)))
  member = _group_of(rows, groups, fields)
  seeds = "seeds"
  for i, r in enumerate(rows):
    if i in member and r.get(key) is not None:
      ax.plot(xs[member[i]], r[key], "o", color="0.6", ms=4, label=seeds)
      seeds = None
  ax.errorbar(xs, [g[f"{key}_mean"] for g in groups],
              yerr=[g[f"{key}_std"] or 0 for g in groups], fmt="s", capsize=4,
              color="C0", label="mean ± std over seeds")
  if single:
    ax.set_xlabel(readable(fields[0]))
    ax.set_xticks(sorted(set(xs)))
  else:
    ax.set_xticks(xs, [g["label"] for g in groups], rotation=30, ha="right")
  ax.set(ylabel=f"final {METRIC_NAMES[metric]}")
  ax.grid(alpha=0.3)
  report_style.legend(ax, below=True)  # A row under the axes keeps the column's width.
  report_style.save(plt, fig, path)


def _context_length(plt, groups, path, metric="loss", xlabel="") -> bool:
  lengths = sorted({m.n for g in groups for k in g if (m := at_length(k))
                    and (m.metric, m.relative, m.stat) == (metric, True, "mean")})
  if not lengths:
    return False
  fig, ax = report_style.figure(plt)
  for g in groups:
    if g.get(f"final_{metric}_mean") is None:
      continue
    xs, ys, es = [1], [g[f"final_{metric}_mean"]], [g[f"final_{metric}_std"] or 0]
    for n in lengths:
      if g.get(f"{metric}@{n}L_mean") is not None:
        xs.append(n)
        ys.append(g[f"{metric}@{n}L_mean"])
        es.append(g[f"{metric}@{n}L_std"] or 0)
    ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=g["label"])
  ax.set_xscale("log", base=2)
  ax.set_xticks([1, *lengths], [f"{n}L" if n > 1 else "L" for n in [1, *lengths]])
  ax.set(xlabel=xlabel, ylabel=METRIC_NAMES[metric])
  ax.grid(alpha=0.3)
  report_style.legend(ax)
  report_style.save(plt, fig, path)
  return True


def _domains(plt, groups, path, ood) -> bool:
  """Final bits per byte per domain (x), one series per group, mean ± std over seeds."""
  names = sorted({k[len("bpb/"):-len("_mean")] for g in groups for k in g
                  if k.startswith("bpb/") and k.endswith("_mean")})
  if not names:
    return False
  fig, ax = report_style.figure(plt)
  width = 0.8 / max(len(groups), 1)
  for i, g in enumerate(groups):
    xs = [j for j, n in enumerate(names) if g.get(f"bpb/{n}_mean") is not None]
    ax.errorbar([x + (i - (len(groups) - 1) / 2) * width for x in xs],
                [g[f"bpb/{names[j]}_mean"] for j in xs],
                yerr=[g[f"bpb/{names[j]}_std"] or 0 for j in xs], fmt="o", capsize=3,
                label=g["label"])
  ax.set_xticks(range(len(names)), [n + (" (OOD)" if f"bpb/{n}" in ood else "")
                                    for n in names])
  ax.set(xlabel="evaluation corpus", ylabel="final eval bits per byte")
  ax.grid(alpha=0.3, axis="y")
  report_style.legend(ax)
  report_style.save(plt, fig, path)
  return True


def plot_all(root: str, out: str, rows: list[dict], groups: list[dict],
             fields: list[str], metric: str = "loss", ood=frozenset()) -> dict[str, str]:
  """Writes the plots of `metric` ("loss" or "bpb") into `out`; returns {kind: path}.
  `ood`: the bpb/<name> columns of out-of-domain corpora (marked in domains.png)."""
  if metric not in METRIC_NAMES:
    raise ValueError(f"metric={metric!r}: must be one of {sorted(METRIC_NAMES)}")
  plt = report_style.pyplot()
  if plt is None:
    log.warning("matplotlib is not installed: no plots (pip install -e .[report])")
    return {}
  paths = {"eval_loss_plot": os.path.join(out, "eval_loss.png")}
  with plt.rc_context(PAPER_STYLE):
    _eval_loss(plt, root, rows, groups, fields, paths["eval_loss_plot"], metric)
    if groups:
      paths["final_loss_plot"] = os.path.join(out, "final_loss.png")
      _final_loss(plt, rows, groups, fields, paths["final_loss_plot"], metric)
      for kind, draw in (("context_length", lambda p: _context_length(
          plt, groups, p, metric, report_tasks.length_label(rows, "eval context length"))),
                         ("domains", lambda p: _domains(plt, groups, p, ood))):
        if draw(os.path.join(out, f"{kind}.png")):
          paths[f"{kind}_plot"] = os.path.join(out, f"{kind}.png")
    paths.update(report_tasks.plot_all(plt, root, out, rows, groups))
    if report_telemetry.plot_attn_logits(plt, root, rows, os.path.join(out, "attn_logit_max.png")):
      paths["attn_logit_max_plot"] = os.path.join(out, "attn_logit_max.png")
  # Each plot's PDF twin: "eval_loss_pdf", ...
  paths.update({k.replace("_plot", "_pdf"): os.path.splitext(p)[0] + ".pdf"
                for k, p in list(paths.items())})
  return paths

"""The report's compute-matched part: per-variant learning rates, fitted laws, plot.

Writes, beside the tables (experiments/report/__init__.py calls `write`):
  lr.md, lr.tex        with an lr grid: each variant at its own best lr (lr.py), its
                       lr sensitivity and diverged runs (sensitivity.py)
  lr_loss.png, .pdf    final loss against lr (log axis) per variant, seeds' spread
  fits.md, fits.tex    for a ladder (train.steps swept), per variant L(C) = E + A (C/C0)^-alpha
  fits.json            with 95% intervals and the compute multiplier against the baseline
                       (fits.py)
  compute.png, .pdf    final loss against training FLOPs (log axis): every group's mean
                       with its seeds' spread, each variant's frontier and fitted law,
                       solid over the measured compute and dashed (labelled) beyond it
"""

from __future__ import annotations

import json
import os

import numpy as np

from experiments.report import fits as report_fits, lr as report_lr
from experiments.report import sensitivity as report_sensitivity, style as report_style


def _plot(plt, fits: list[dict], path: str) -> None:
  fig, ax = report_style.figure(plt)
  c_hi = max(r["c_max"] for r in fits if r["c_max"]) * 4  # Extrapolate to 4x the data.
  extrapolated = False
  for i, r in enumerate(fits):
    colour = f"C{i % 10}"
    cs, ls = zip(*r["all_points"])
    ax.plot(cs, ls, "o", color=colour, alpha=0.35, ms=3)
    fc, fl = zip(*r["front"])
    ax.plot(fc, fl, "o", color=colour, ms=3.5)
    law = r["law"]
    if law is None:
      ax.plot([], [], "o", color=colour, label=f"{r['variant']} (no fit)")
      continue
    inside = np.geomspace(r["c_min"], r["c_max"], 50)
    ax.plot(inside, law(inside), "-", color=colour,
            label=f"{r['variant']}: α={law.alpha:.2f}, E={law.E:.2f}")
    beyond = np.geomspace(r["c_max"], c_hi, 20)
    ax.plot(beyond, law(beyond), "--", color=colour, lw=0.8)
    extrapolated = True
  if extrapolated:
    ax.plot([], [], "--", color="0.4", lw=0.8, label="extrapolated")
  ax.set_xscale("log")
  ax.set(xlabel="training FLOPs", ylabel=f"final {report_style.METRIC_NAMES['loss']}")
  ax.grid(alpha=0.3, which="both")
  report_style.legend(ax)
  report_style.save(plt, fig, path)


def write(out: str, groups: list[dict], fields: list[str], tex,
          rows: list[dict] | None = None) -> tuple[dict, str]:
  """Writes the files above that apply; returns ({kind: path}, text to print). `rows`:
  every run (report.collect's), for the lr sensitivity (diverged runs are not in groups)."""
  paths, text = {}, []
  best = report_lr.best_lr_groups(groups, fields, rows)
  if report_lr.LR in fields:
    paths["lr_markdown"], paths["lr_latex"] = (os.path.join(out, f) for f in ("lr.md", "lr.tex"))
    with open(paths["lr_markdown"], "w") as f:
      f.write(report_lr.markdown(best))
    with open(paths["lr_latex"], "w") as f:
      f.write(report_lr.latex(best, tex))
    edges = [g["label"] for g in best if g["lr_edge"]]
    text.append(f"best lr per variant: {paths['lr_markdown']}" +
                (f" (at the grid's edge: {', '.join(edges)})" if edges else ""))
    plt = report_style.pyplot()
    if plt is not None and any("lr_points" in g for g in best):
      paths["lr_plot"], paths["lr_pdf"] = (os.path.join(out, f"lr_loss.{x}") for x in ("png", "pdf"))
      with plt.rc_context(report_style.PAPER_STYLE):
        report_sensitivity.plot(plt, [g for g in best if "lr_points" in g], paths["lr_plot"])
  fits = report_fits.fit_all(best, fields) if report_fits.is_ladder(fields) else []
  if not any(r["law"] for r in fits):  # No ladder, or too few frontier points: no law.
    return paths, "\n".join(text)
  for kind, name, body in (("fits_markdown", "fits.md", report_fits.markdown(fits)),
                           ("fits_latex", "fits.tex", report_fits.latex(fits, tex)),
                           ("fits", "fits.json", json.dumps(report_fits.records(fits), indent=1))):
    paths[kind] = os.path.join(out, name)
    with open(paths[kind], "w") as f:
      f.write(body)
  text.append(report_fits.describe(fits))
  plt = report_style.pyplot()
  if plt is not None:
    paths["compute_plot"] = os.path.join(out, "compute.png")
    paths["compute_pdf"] = os.path.join(out, "compute.pdf")
    with plt.rc_context(report_style.PAPER_STYLE):
      _plot(plt, fits, paths["compute_plot"])
  return paths, "\n".join(text)

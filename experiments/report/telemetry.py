"""The report's stability figure: attn_logit_max.png, the per-layer max attention logit
over training steps (train.telemetry's `telemetry/attn_logit_max/L<i>` lines,
train/telemetry.py), one panel per sweep point (run), one line per layer, a shared y
axis so the runs compare. Runs without the telemetry (train.telemetry=False, an
attention kernel that does not report it, or older runs) get no panel; with none at all
there is no figure. docs/stability.md says how to read it."""

from __future__ import annotations

import math
import re

from experiments.report import style as report_style
from experiments.report.style import COLUMN_WIDTH
from train.io import storage
from train.metrics import read_metrics

KEY = re.compile(r"telemetry/attn_logit_max/L(\d+)$")
MAX_PANELS = 24  # A sweep beyond this is plotted for its first 24 points (said in the log).


def logit_series(workdir: str) -> dict[int, tuple[list[int], list[float]]]:
  """{layer: (steps, max attention logits)} from a run's train lines."""
  series: dict[int, tuple[list[int], list[float]]] = {}
  for m in read_metrics(workdir, warn=False):
    if m.get("split") != "train":
      continue
    for k, v in m.items():
      if (hit := KEY.match(k)) and isinstance(v, (int, float)):
        steps, values = series.setdefault(int(hit.group(1)), ([], []))
        steps.append(m["step"])
        values.append(v)
  return series


def plot_attn_logits(plt, root: str, rows: list[dict], path: str) -> bool:
  """Writes `path` (and its PDF twin); False when no run logged the telemetry."""
  runs = [(r["run"], s) for r in rows if (s := logit_series(storage.join(root, r["run"])))]
  if not runs:
    return False
  runs = runs[:MAX_PANELS]
  cols = min(len(runs), 3)
  nrows = math.ceil(len(runs) / cols)
  fig, axes = plt.subplots(nrows, cols, figsize=(COLUMN_WIDTH * cols / 1.5, 1.6 * nrows),
                           layout="constrained", sharey=True, squeeze=False)
  for ax, (name, series) in zip(axes.flat, runs):
    for layer in sorted(series):
      ax.plot(*series[layer], label=f"layer {layer}", lw=1)
    # Which sweep point: a panel label above the axes (a paper figure has no titles; its
    # caption says what the figure is, the label which panel is which run).
    ax.annotate(name, (0.5, 1.0), xycoords="axes fraction", ha="center", va="bottom",
                fontsize="small")
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
  for ax in axes.flat[len(runs):]:
    ax.set_visible(False)
  for ax in axes.flat[:len(runs)]:  # Each panel has its own step range.
    ax.set_xlabel("training step")
  for ax in axes[:, 0]:
    ax.set_ylabel("max attention logit")
  report_style.legend(axes.flat[len(runs) - 1])
  report_style.save(plt, fig, path)
  return True

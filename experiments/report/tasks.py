"""The report's evaluation-task columns and plots (eval.tasks: docs/evaluation.md).

Columns (results.csv, summary.csv, the tables), from each run's last eval line and the
`--mode eval` records of that checkpoint which changed only task fields (evals.jsonl):
  <task>/<metric>        a harness task's figures (acc, acc_norm, exact_match, ...)
  passkey/exact, passkey/exact@2L, ...   retrieval at L, 2L, ... (mean over depths);
                         passkey/rank@2L the true key's mean log-likelihood rank,
                         passkey/logp@2L its mean log-likelihood (nats)
Plots (PNG + PDF, in style.py's paper style):
  <task>_by_length       retrieval accuracy vs length, one line per group (mean ± std)
  heatmaps/<task>_<run>  depth x length exact-match heat-map of each finished run that
                         was scored on it: in training's eval lines or by a task-only
                         `--mode eval` of its final checkpoint (evals.jsonl)
"""

from __future__ import annotations

import os
import re

from experiments.report import style as report_style
from experiments.report.notes import finite
from train.io import storage
from train.eval.mode import read_evals
from train.eval.tasks import DEFAULTS
from train.metrics import read_metrics

# passkey/exact@256/depth50 (a cell), passkey/exact@256, passkey/exact (at L).
_RETRIEVAL = re.compile(r"^(passkey|multi_needle)/(exact|rank|logp)(?:@(\d+))?(?:/depth(\d+))?$")
_SKIP = ("_stderr", "/n", "/untokenizable")
_NOT_TASKS = ("loss/", "bpb/")  # Named evaluation corpora (report.py's domain columns).


def task_evals(run_dir: str, step: int) -> dict:
  """Task figures of `--mode eval` records (RUN/evals.jsonl) of checkpoint `step` that
  changed only task fields (the model evaluated is the trained one), later ones winning."""
  out = {}
  for record in read_evals(run_dir):
    fields = {k.partition(".")[2] for k in record.get("overrides", {})}
    if record.get("step") == step and fields <= set(DEFAULTS):
      out.update({k: v for k, v in record.items() if "/" in k})
  return out


def run_figures(run_dir: str, last: dict, seq_len: int) -> dict:
  """The task columns of a run: its last eval line, then its task-only --mode evals."""
  return task_metrics(last, seq_len, task_evals(run_dir, last.get("step")))


def task_metrics(last: dict, seq_len: int, evals: dict | None = None) -> dict:
  """The task columns of one run's last eval line, with `evals` (task_evals) on top."""
  out = {}
  for key, value in {**last, **(evals or {})}.items():
    if "/" not in key or key.endswith(_SKIP) or key.startswith(_NOT_TASKS):
      continue
    m = _RETRIEVAL.match(key)
    if m and m.group(4) is not None:
      continue  # Heat-map cells: the plot reads them, the tables do not.
    if m and m.group(3) and seq_len and int(m.group(3)) % seq_len == 0:
      key = f"{m.group(1)}/{m.group(2)}@{int(m.group(3)) // seq_len}L"
    out[key] = finite(value)
  return out


def columns(rows: list[dict]) -> list[str]:
  """Task columns present in any row: harness tasks first, then retrieval by length."""
  keys = {k for r in rows for k in r if "/" in k and not k.startswith(_NOT_TASKS)}

  def order(k):
    m = re.match(r"^(passkey|multi_needle)/(exact|rank|logp)(?:@(\d+)L)?$", k)
    return (1, m.group(1), m.group(2), int(m.group(3) or 1)) if m else (0, k, "", 0)
  return sorted(keys, key=order)


RECIPE = "docs/evaluation.md, \"The passkey recipe\" (experiments/configs/passkey_task.py)"


def at_chance(groups: list[dict]) -> list[str]:
  """Warnings for the retrieval tasks whose exact match is 0 at every length of every
  group (the true key's rank at chance): the models never learned to retrieve, so the
  task measures nothing between them."""
  out = []
  for task in ("passkey", "multi_needle"):
    pattern = re.compile(rf"^{task}/exact(?:@\d+L)?_mean$")
    values = [v for g in groups for k, v in g.items() if pattern.match(k) and v is not None]
    if values and max(values) == 0:
      out.append(f"{task}: exact match is 0.00 at every length for every variant (at "
                 "chance): these models never learned to retrieve a key, so the task does "
                 f"not separate them; train on passkey samples first: {RECIPE}")
  return out


def length_label(rows: list[dict], what: str = "context length") -> str:
  """The x label of a plot over multiples of L, with L in tokens when the runs share it."""
  lengths = {r.get("_seq_len") for r in rows if r.get("_seq_len")}
  known = f"L = {lengths.pop()} tokens" if len(lengths) == 1 else "L = training length"
  return f"{what} (tokens; {known})"


# Per group: a marker, a line style and a small shift along x, so that lines lying on top
# of each other (every variant at 0.00) stay told apart.
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LINESTYLES = ("-", "--", ":", "-.")


def series_style(i: int, count: int) -> tuple[dict, float]:
  """(errorbar keywords, x factor) of the i-th of `count` series on a log2 axis."""
  shift = 2 ** (0.06 * (i - (count - 1) / 2))
  return {"marker": MARKERS[i % len(MARKERS)],
          "linestyle": LINESTYLES[i % len(LINESTYLES)]}, shift


def _by_length(plt, groups: list[dict], task: str, path: str, xlabel: str) -> bool:
  pattern = re.compile(rf"^{task}/exact(?:@(\d+)L)?_mean$")
  lengths = sorted({int(m.group(1) or 1) for g in groups for k in g if (m := pattern.match(k))})
  if not lengths:
    return False
  fig, ax = report_style.figure(plt)
  col = lambda n: f"{task}/exact" + ("" if n == 1 else f"@{n}L")
  drawn = [g for g in groups if any(g.get(col(n) + "_mean") is not None for n in lengths)]
  for i, g in enumerate(drawn):
    xs = [n for n in lengths if g.get(col(n) + "_mean") is not None]
    style, shift = series_style(i, len(drawn))
    ax.errorbar([x * shift for x in xs], [g[col(n) + "_mean"] for n in xs],
                yerr=[g[col(n) + "_std"] or 0 for n in xs], capsize=3, label=g["label"],
                **style)
  ax.set_xscale("log", base=2)
  ax.set_xticks(lengths, [f"{n}L" if n > 1 else "L" for n in lengths])
  ax.set(xlabel=xlabel, ylabel="exact match (fraction)", ylim=(-0.05, 1.05))
  ax.grid(alpha=0.3)
  report_style.legend(ax)
  report_style.save(plt, fig, path)
  return True


def _heatmap(plt, task: str, last: dict, path: str) -> bool:
  cells = {}
  for key, value in last.items():
    m = _RETRIEVAL.match(key)
    if m and m.group(1) == task and m.group(2) == "exact" and m.group(4) is not None:
      cells[(int(m.group(3)), int(m.group(4)))] = finite(value)
  if not cells:
    return False
  lengths = sorted({l for l, _ in cells})
  depths = sorted({d for _, d in cells})
  grid = [[cells.get((l, d)) if cells.get((l, d)) is not None else float("nan")
           for l in lengths] for d in depths]
  fig, ax = report_style.figure(plt)
  image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
  ax.set_xticks(range(len(lengths)), [str(l) for l in lengths])
  ax.set_yticks(range(len(depths)), [f"{d}%" for d in depths])
  ax.set(xlabel="context length (tokens)", ylabel="needle depth (% of the context)")
  fig.colorbar(image, ax=ax, label="exact match (fraction)")
  os.makedirs(os.path.dirname(path), exist_ok=True)  # Only for a map that is drawn.
  report_style.save(plt, fig, path)
  return True


def plot_all(plt, root: str, out: str, rows: list[dict], groups: list[dict]) -> dict:
  """Writes the task plots; {kind: path} of the PNGs written."""
  paths = {}
  for task in ("passkey", "multi_needle"):
    path = os.path.join(out, f"{task}_by_length.png")
    if groups and _by_length(plt, groups, task, path, length_label(rows)):
      paths[f"{task}_by_length_plot"] = path
    for r in rows:
      if r["status"] != "finished":
        continue
      run_dir = storage.join(root, r["run"])
      evals = [e for e in read_metrics(run_dir, warn=False) if e.get("split") == "eval"]
      if not evals:
        continue
      name = "run" if r["run"] == "." else r["run"].replace(os.sep, "_").replace("/", "_")
      path = os.path.join(out, "heatmaps", f"{task}_{name}.png")
      scored = {**evals[-1], **task_evals(run_dir, evals[-1].get("step"))}
      if _heatmap(plt, task, scored, path):
        paths[f"{task}_heatmap_{name}_plot"] = path
  return paths

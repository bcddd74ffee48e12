"""What the report's tables leave out or cannot show, said next to them.

The grouped tables (summary.csv, table.md, table.tex) average finished runs only.
Every other run is listed with the reason it is left out, and runs whose config
changed mid-run (train/lifecycle/changes.py's config_changes.jsonl) or that logged
non-finite values are flagged, so a reader of the tables never loses a run
without a word. The notes go under table.md, into table.tex as comments, and to
the report's printed output; results.csv carries `excluded` and `config_changes`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

from experiments.sweep import FAILED, last_error
from train.io import runlog, storage
from train.lifecycle.changes import read_changes
from train.lifecycle.lock import describe_holder
from train.metrics import METRICS_FILE

COLUMNS = ("excluded", "config_changes")  # results.csv's note columns, after the metrics.
_TITLES = {
    "excluded": "Excluded runs, not in the grouped tables",
    "changed": "Config changed mid-run, as field old->new @step (included above)",
    "nonfinite": "Non-finite metrics, logged as null (included above)",
    "mixture": "Mixture share per domain, of tokens / of bytes (data.mixture_unit sets "
               "which the weights count)",
}


# train/eval/evaluator.py logs `loss@256` (256 tokens); the report names it `loss@2L` (twice
# the training length L); grouped columns add `_mean` / `_std`.
_AT = re.compile(r"^(loss|bpb|accuracy)@(\d+)(L?)(?:_(mean|std))?$")


@dataclasses.dataclass(frozen=True)
class AtLength:
  """A metric at another context length, parsed from its column name."""
  metric: str  # "loss" | "bpb" | "accuracy"
  n: int  # Tokens; with `relative`, multiples of the training length.
  relative: bool  # `@2L` rather than `@256`.
  stat: str  # "" (a run's value) | "mean" | "std" (over seeds).


def at_length(column: str) -> AtLength | None:
  """`loss@256`, `loss@2L`, `loss@2L_mean` ... parsed; None for any other name."""
  m = _AT.match(column)
  if m is None:
    return None
  return AtLength(m.group(1), int(m.group(2)), m.group(3) == "L", m.group(4) or "")


def finite(v: Any) -> float | None:
  """A metric value as a finite number, else None (null, or an old "nan" string)."""
  if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
    return v
  return None


def last_line_cut(run_dir: str) -> bool:
  """metrics.jsonl's last non-empty line is not JSON: a crash cut it mid-write."""
  try:
    lines = [l for _, l in runlog.read_lines(run_dir, METRICS_FILE) if l.strip()]
  except OSError:
    return False
  if not lines:
    return False
  try:
    json.loads(lines[-1])
  except ValueError:
    return True
  return False


def _failure(run_dir: str) -> str:
  return last_error(storage.read_bytes(storage.join(run_dir, FAILED)).decode(errors="replace"))


def exclusion(run_dir: str, row: dict[str, Any], steps: Any, evals: list[dict]) -> str | None:
  """Why this run is left out of the grouped tables, or None if it is in them."""
  cut = last_line_cut(run_dir)
  if row["status"] == "running":
    return describe_holder(row["_holder"])
  if row["status"] == "failed":
    after = (f" (after its final eval at step {steps}: its metrics are complete, its run "
             "is not; re-run the point to settle it)" if row.get("_complete") else "")
    return f"failed: {_failure(run_dir)}{after}"
  if row["status"] == "unfinished":
    if cut and row["step"] == steps:  # The final step's train line is there, its eval is not.
      return (f"no eval line at the final step {steps} (metrics.jsonl's last line was cut: "
              "re-run the same command to log it)")
    where = (f"last logged step {row['step']} of {steps}" if row["step"] else
             f"nothing logged yet (of {steps} steps)")
    return f"unfinished: {where}" + (" (metrics.jsonl's last line was cut by a crash)"
                                     if cut else "")
  if row.get("final_loss") is None:
    return f"non-finite final loss (null at step {evals[-1]['step'] if evals else '?'})"
  return None


def _value(v: Any) -> str:
  return v if isinstance(v, str) else json.dumps(v)


def describe_changes(changes: list[dict]) -> str:
  """config_changes.jsonl as one cell: "train.lr 0.003->0.001 @200; ..."."""
  return "; ".join(f"{c.get('field')} {_value(c.get('old'))}->{_value(c.get('new'))} "
                   f"@{c.get('step')}" for c in changes)


def nonfinite(records: list[dict]) -> str:
  """"loss, grad_norm at steps 3, 4" for the metrics logged as null (or "nan"), else ""."""
  keys, steps = set(), []
  for r in records:
    bad = {k for k, v in r.items() if k not in ("step", "split") and _has_nonfinite(v)}
    if bad:
      keys |= bad
      steps.append(r.get("step"))
  if not keys:
    return ""
  shown = list(dict.fromkeys(steps))  # metrics.jsonl is in step order.
  more = f", ... ({len(shown)} steps)" if len(shown) > 5 else ""
  return (f"{', '.join(sorted(keys))} at step{'s' if len(shown) > 1 else ''} "
          f"{', '.join(str(s) for s in shown[:5])}{more}")


def _has_nonfinite(v: Any) -> bool:
  if isinstance(v, list):  # A vector metric (e.g. MoE expert loads).
    return any(_has_nonfinite(x) for x in v)
  if isinstance(v, str):  # Older metrics.jsonl files wrote non-finite values as strings.
    return v.lower() in ("nan", "inf", "-inf", "infinity", "-infinity")
  if isinstance(v, bool):
    return False
  return v is None or isinstance(v, (int, float)) and not math.isfinite(v)


def run_notes(run_dir: str, row: dict, steps: Any, records: list[dict],
              evals: list[dict]) -> dict[str, str | None]:
  """The note fields of one run's row: excluded, config_changes, nonfinite."""
  return {"excluded": exclusion(run_dir, row, steps, evals),
          "config_changes": describe_changes(read_changes(run_dir)),
          "nonfinite": nonfinite(records)}


# Rendering -------------------------------------------------------------------


def collect_notes(rows: list[dict]) -> dict[str, list[tuple[str, str]]]:
  """{section: [(run, text)]} for the sections that have any run."""
  out = {
      "excluded": [(r["run"], r["excluded"]) for r in rows if r.get("excluded")],
      "changed": [(r["run"], r["config_changes"]) for r in rows if r.get("config_changes")],
      "nonfinite": [(r["run"], r["nonfinite"]) for r in rows if r.get("nonfinite")],
      "mixture": _mixture_shares(rows),
  }
  return {k: v for k, v in out.items() if v}


def _mixture_shares(rows: list[dict]) -> list[tuple[str, str]]:
  """[(run, "code 70.0% / 64.1%, docs 30.0% / 35.9%")], once for "every run" sharing it."""
  out = [(r["run"], ", ".join(f"{d} {100 * t:.1f}% / {100 * s['bytes'].get(d, 0):.1f}%"
                              for d, t in s["tokens"].items()))
         for r in rows if isinstance(s := r.get("_mixture_share"), dict) and "tokens" in s]
  if len(out) > 1 and len({text for _, text in out}) == 1:
    return [("every run", out[0][1])]
  return out


def _one_line(text: str) -> str:
  return " ".join(str(text).split())


def _sections(notes: dict[str, list[tuple[str, str]]], total: int):
  for key, items in notes.items():
    count = f" ({len(items)} of {total} runs)" if key == "excluded" else ""
    yield f"{_TITLES[key]}{count}:", [(run, _one_line(text)) for run, text in items]


def markdown_notes(notes: dict[str, list[tuple[str, str]]], total: int) -> str:
  return "".join(f"\n**{title}**\n\n" + "".join(f"- `{run}`: {text}\n" for run, text in items)
                 for title, items in _sections(notes, total))


def latex_notes(notes: dict[str, list[tuple[str, str]]], total: int) -> str:
  """LaTeX comments: seen by whoever pastes the table, absent from the PDF."""
  return "".join(f"% {title}\n" + "".join(f"%   {run}: {text}\n" for run, text in items)
                 for title, items in _sections(notes, total))


def text_notes(notes: dict[str, list[tuple[str, str]]], total: int) -> str:
  return "".join(f"{title}\n" + "".join(f"  {run}: {text}\n" for run, text in items)
                 for title, items in _sections(notes, total))

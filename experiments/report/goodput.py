"""The report's goodput tables: goodput.csv and goodput.md, a row per run that keeps a
ledger (RUN/goodput.jsonl, train/lifecycle/goodput.py): goodput (productive / wall), the wall
time, the attempts, the steps trained once and again, and the breakdown of the wall
time by category (seconds, and percent in goodput.md), which sums to the wall time.
No run with a ledger: no files."""

from __future__ import annotations

import csv
import os

from train.io import storage
from train.lifecycle import goodput as ledger


def _row(run: str, g: ledger.Goodput) -> dict:
  return {"run": run, "goodput": g.goodput, "wall_s": g.wall_s, "attempts": len(g.attempts),
          "steps_productive": g.steps.get("productive", 0),
          "steps_redone": g.steps.get("redone", 0),
          **{f"{k}_s": g.seconds.get(k, 0.0) for k in ledger.CATEGORIES}}


def write(root: str, out: str, runs: list[str]) -> dict[str, str]:
  """Writes OUT/goodput.csv and OUT/goodput.md for `runs` (names under `root`)."""
  found = [(run, g) for run in runs
           if (g := ledger.summary(storage.join(root, run) if run != "." else root))]
  if not found:
    return {}
  rows = [_row(run, g) for run, g in found]
  paths = {"goodput_csv": os.path.join(out, "goodput.csv"),
           "goodput_md": os.path.join(out, "goodput.md")}
  with open(paths["goodput_csv"], "w", newline="") as f:
    writer = csv.DictWriter(f, list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
  head = ["run", "goodput", "wall", "attempts", "steps (redone)", *ledger.CATEGORIES]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for (run, g), r in zip(found, rows):
    share = g.fractions()
    lines.append("| " + " | ".join([
        run, f"{100 * g.goodput:.1f}%", f"{g.wall_s:.1f} s", str(r["attempts"]),
        f"{r['steps_productive'] + r['steps_redone']} ({r['steps_redone']})",
        *(f"{g.seconds[k]:.1f} s ({100 * share[k]:.1f}%)" for k in ledger.CATEGORIES)]) + " |")
  with open(paths["goodput_md"], "w") as f:
    f.write("Goodput: productive step time / wall time (first process start to the last "
            "record), with where the wall time went; the categories sum to it "
            "(train/lifecycle/goodput.py).\n\n" + "\n".join(lines) + "\n")
  return paths

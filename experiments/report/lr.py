"""A learning rate per variant: the report picks each variant's best lr of a grid.

When `train.lr` is among a sweep's swept fields, the groups (runs that differ only
in their seed) that agree on every other swept field form one lr grid; its best lr
is the one with the lowest seed-averaged final loss. A best lr at the smallest or
largest lr of its grid is flagged: the optimum may lie outside the grid, so widen
it. `lr.md` / `lr.tex` table every variant at its own best lr, with its difference
to the baseline at the baseline's own best lr (experiments/report/stats.py), and
the fits (fits.py) use only best-lr groups.
"""

from __future__ import annotations

import json

from experiments.report import sensitivity as report_sensitivity, stats as report_stats
from train.io import storage
from train.lifecycle.config_record import read_record

LR = "train.lr"


def _grid_key(g: dict, fields: list[str]) -> str:
  return json.dumps([g["label_sans_lr"]] + [g.get(f) for f in fields if f != LR], default=str)


def best_lr_groups(groups: list[dict], fields: list[str],
                   rows: list[dict] | None = None) -> list[dict]:
  """One group per lr grid, the best; each carries `lr_grid` and `lr_edge`, and with
  `rows` (every run, diverged ones too) `lr_points` {(lr, seed): outcome} and
  `sensitivity` (sensitivity.py). Without an lr grid: the groups as they are."""
  if LR not in fields:
    return groups
  by_grid = report_sensitivity.grid_points(rows or [], lambda r: _grid_key(
      {"label_sans_lr": _strip_lr(report_sensitivity.seed_name(r)), **r}, fields))
  grids: dict[str, list[dict]] = {}
  for g in groups:
    g["label_sans_lr"] = _strip_lr(g["label"])
    grids.setdefault(_grid_key(g, fields), []).append(g)
  out = []
  for members in grids.values():
    scored = [g for g in members if g.get("final_loss_mean") is not None]
    if not scored:
      continue
    best = min(scored, key=lambda g: g["final_loss_mean"])
    key = _grid_key(best, fields)
    lrs = sorted({g[LR] for g in members} | {lr for lr, _ in by_grid.get(key, {})})
    row = {**best, "label": best["label_sans_lr"], "lr_grid": lrs,
           "lr_edge": len(lrs) > 1 and best[LR] in (lrs[0], lrs[-1])}
    if key in by_grid and len(lrs) > 1:  # One lr (a tuned setting) has no sensitivity.
      row["lr_points"] = by_grid[key]
      row["sensitivity"] = report_sensitivity.sensitivity(by_grid[key])
    out.append(row)
  other = [f for f in fields if f != LR]
  report_stats.add_significance(out, other)
  for g, b in zip(out, report_stats.baseline_index(out, other)):
    report_sensitivity.add_delta(g, out[b])
  return out


def tuned_settings(root: str, variant: str, over: tuple[str, ...], steps: int) -> dict:
  """{value of `variant` (e.g. each train.optimizer): {field: value} of `over`} -- each
  variant's best setting of the grid over `over` (train.lr, train.weight_decay, ...) among
  the finished runs under `root` at `steps` training steps, by the lowest seed-mean final
  loss. Every such run ends its own WSD cooldown (a trunk's or a decay branch's end,
  experiments/sweep/branch.py), so the choice is made at the end of a decay, never on a
  stable-phase loss. Refused while any run under `root` is unfinished or failed (the grid
  would be judged on part of its points), or where a run is not a WSD one."""
  # Imported here: experiments.report.runs imports this module's users (a cycle at import).
  from experiments.report import runs as report_runs  # pylint: disable=g-import-not-at-top
  from experiments.report import groups as report_groups  # pylint: disable=g-import-not-at-top
  _, rows, fields = report_runs.collect(root)
  pending = [r["run"] for r in rows if r["status"] != "finished" or r.get("excluded")]
  if pending:
    raise ValueError(f"{root}: {len(pending)} run(s) not finished ({', '.join(pending[:4])}"
                     f"{', ...' if len(pending) > 4 else ''}): finish the sweep (re-run it) "
                     "before picking settings from it")
  for r in rows:
    schedule = (read_record(storage.join(root, r["run"])) or {}).get("train", {}).get("schedule")
    if schedule != "wsd":
      raise ValueError(f"{root}/{r['run']}: train.schedule={schedule!r}; tuned settings are "
                       "picked at the end of a WSD cooldown only")
  at = [r for r in rows if r.get("train.steps", r.get("step")) == steps]
  if not at:
    raise ValueError(f"{root}: no finished run at {steps} steps")
  groups = report_groups.group_rows(at, [f for f in fields if f != "seed"], ["final_loss"])
  best: dict = {}
  for g in groups:
    key, loss = g.get(variant), g.get("final_loss_mean")
    if loss is not None and (key not in best or loss < best[key][0]):
      best[key] = (loss, {f: g.get(f) for f in over})
  return {k: v for k, (_, v) in best.items()}


def _strip_lr(label: str) -> str:
  """`m-mha-lr0.003-t17` -> `m-mha-t17` (the ladder's names); other labels as they are."""
  parts = label.split("-")
  return "-".join(p for p in parts if not (p.startswith("lr") and _is_number(p[2:])))


def _is_number(text: str) -> bool:
  try:
    float(text)
  except ValueError:
    return False
  return True


def _rows(best: list[dict]) -> tuple[list[str], list[list[str]]]:
  header = ["run", "best lr", "grid", "final_loss", "Δ final_loss [95% CI]", "n"]
  sens = any("sensitivity" in g for g in best)
  if sens:
    header += ["lr sensitivity", "Δ lr sensitivity [95% CI]", "diverged"]
  body = []
  for g in best:
    lr = f"{g[LR]:g}" + (" (edge)" if g["lr_edge"] else "")
    loss = f"{g['final_loss_mean']:.4f}" + (f" ± {g['final_loss_std']:.4f}"
                                                   if g["final_loss_std"] is not None else "")
    body.append([g["label"], lr, " ".join(f"{x:g}" for x in g["lr_grid"]), loss,
                 report_stats.delta_cell(g), report_stats.n_cell(g)])
    if sens:
      s = g.get("sensitivity")
      body[-1] += ([report_sensitivity.cell(s), report_sensitivity.delta_cell(g),
                    report_sensitivity.diverged_cell(s)] if s else ["—"] * 3)
  return header, body


def markdown(best: list[dict]) -> str:
  header, body = _rows(best)
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(r) + " |" for r in body]
  notes = [report_stats.note(best)]
  if any("sensitivity" in g for g in best):
    notes.append(report_sensitivity.note(best))
  if any(g["lr_edge"] for g in best):
    notes.append("(edge): the best lr is the smallest or largest of its grid; the optimum "
                 "may lie outside it: widen the grid.")
  return "\n".join(lines) + "\n\n" + " ".join(n for n in notes if n) + "\n"


def latex(best: list[dict], tex) -> str:
  header, body = _rows(best)
  lines = ["\\begin{tabular}{l" + "r" * (len(header) - 1) + "}", "\\toprule",
           " & ".join(tex(h) for h in header) + " \\\\", "\\midrule"]
  lines += [" & ".join(tex(c) for c in r) + " \\\\" for r in body]
  return "\n".join(lines + ["\\bottomrule", "\\end{tabular}"]) + "\n"

"""The grouped tables, table.md and table.tex: their columns, cells and legends.

Each metric column is followed by its difference to the baseline, Δ [95% CI] p
(stats.py), and every cell states its own count where it is fewer than its
row's seeds: `0.4167 (n=1)` (a metric some seeds did not measure is averaged over
those that did, and says so; no ± from one value). Out-of-domain evaluation corpora
(eval.corpora, not in the training data) are marked `(OOD)` in the header.

Columns: `--columns final_bpb,bpb/man,unix_mc/acc` sets both tables' metric columns;
by default table.md shows every model metric (report.write_report's `shown`) and
table.tex only the headline metric (`final_loss`, or `final_bpb`), so that it fits a
page: run, the swept fields, the metric, its Δ and n. summary.csv holds all of them.
"""

from __future__ import annotations

import itertools
import re

from experiments.report import stats as report_stats

EXACT = ("params", "active_params", "kv_bytes_per_token")  # Equal across seeds: no ±.
OOD = " (OOD)"


def fmt_number(m: str, v: float) -> str:
  if m == "flops":
    return f"{v:.3g}"
  if m in EXACT or m in ("tokens", "tokens_per_s"):
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
      if abs(v) >= scale:
        return f"{v / scale:.3g}{unit}"
    return f"{v:.0f}"
  return f"{v:.4f}" if abs(v) < 100 else f"{v:.1f}"


def cell(g: dict, m: str) -> str:
  """mean ± std over the seeds that measured `m`, with (n=k) when they are fewer than
  the row's; one value is printed without ±; none is blank."""
  mean, std, k = g.get(f"{m}_mean"), g.get(f"{m}_std"), g.get(f"{m}_n", g["n"])
  if mean is None:
    return ""
  text = fmt_number(m, mean)
  if m not in EXACT and std is not None and k > 1:
    text += f" ± {fmt_number(m, std)}"
  return text + (f" (n={k})" if k < g["n"] and m not in EXACT else "")


def select(spec: str | None, available: list[str], default: list[str]) -> list[str]:
  """`--columns` ("a,b") checked against the report's metric columns, else `default`."""
  if spec is None:
    return default
  wanted = [c.strip() for c in spec.split(",") if c.strip()]
  unknown = [c for c in wanted if c not in available]
  if not wanted or unknown:
    raise ValueError(f"--columns={spec}: {', '.join(unknown) or 'no column named'}: the "
                     f"report's metric columns are {', '.join(available)}")
  return wanted


def _table(groups: list[dict], fields: list[str], metrics: list[str],
           ood: frozenset) -> tuple[list[str], list[list[str]]]:
  header = ["run", *(f.split(".")[-1] for f in fields)]
  for m in metrics:
    header.append(m + (OOD if m in ood else ""))
    if report_stats.compared(m):
      header.append(f"Δ {m} [95% CI]")
  body = []
  for g in groups:
    row = [g["label"], *(str(g[f]) for f in fields)]
    for m in metrics:
      row.append(cell(g, m))
      if report_stats.compared(m):
        row.append(report_stats.delta_cell(g, m))
    body.append(row + [report_stats.n_cell(g)])
  return header + ["n"], body


def _interactions(groups: list[dict], metrics: list[str]) -> list[list[str]]:
  """[variant, "A − B", interval] for each row and pair of domains shown."""
  out = []
  for g in groups:
    for a, b in itertools.combinations(report_stats.domains(metrics), 2):
      k = report_stats.interaction_key(a, b)
      if g.get("baseline") and g.get(k) is not None:
        out.append([g["label"], f"{a} − {b}", report_stats.interval_cell(
            g[k], g[f"{k}_lo"], g[f"{k}_hi"], g[f"p_{k}"])])
  return out


def _legend(groups: list[dict], ood: frozenset, metrics: list[str]) -> str:
  text = report_stats.note(groups)
  if ood & set(metrics):
    text += (" (OOD): an evaluation corpus (eval.corpora) outside the training data.")
  return text.strip()


def markdown(groups: list[dict], fields: list[str], metrics: list[str],
             ood: frozenset = frozenset()) -> str:
  header, body = _table(groups, fields, metrics, ood)
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(row) + " |" for row in body]
  text = "\n".join(lines) + "\n"
  ix = _interactions(groups, metrics)
  if ix:
    text += ("\n**Domain interaction**: (Δ on A) − (Δ on B), each run's A − B against its "
             "baseline's, 95% CI over seeds\n\n| run | domains | Δ A − Δ B [95% CI] |\n"
             "|---|---|---|\n" + "".join(f"| {' | '.join(r)} |\n" for r in ix))
  legend = _legend(groups, ood, metrics)
  return text + (f"\n{legend}\n" if legend else "")


_TEX = {"\\": r"\textbackslash{}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
        "±": r"$\pm$", "Δ": r"$\Delta$", "†": r"$^\dagger$", "−": r"$-$",
        **{c: "\\" + c for c in "_%&#${}"}}


def tex(text: str) -> str:
  """Plain text (run names, values) as LaTeX source that prints it verbatim; one pass,
  so the escapes' own backslashes and braces are never escaped again."""
  return re.sub("|".join(map(re.escape, _TEX)), lambda m: _TEX[m.group()], text)


def tabular(header: list[str], body: list[list[str]]) -> list[str]:
  lines = ["\\begin{tabular}{l" + "r" * (len(header) - 1) + "}", "\\toprule",
           " & ".join(tex(h) for h in header) + " \\\\", "\\midrule"]
  return lines + [" & ".join(tex(c) for c in row) + " \\\\" for row in body] + [
      "\\bottomrule", "\\end{tabular}"]


def latex(groups: list[dict], fields: list[str], metrics: list[str],
          ood: frozenset = frozenset()) -> str:
  lines = tabular(*_table(groups, fields, metrics, ood))
  ix = _interactions(groups, metrics)
  if ix:
    lines += ["", "% Domain interaction: (Δ on A) − (Δ on B), 95% CI over seeds",
              *tabular(["run", "domains", "Δ A − Δ B [95% CI]"], ix)]
  legend = _legend(groups, ood, metrics)
  return "\n".join(lines) + "\n" + (f"% {legend}\n" if legend else "")

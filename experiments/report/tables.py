"""The grouped tables, table.md and table.tex: their columns, cells and legends.

Each metric column is followed by its difference to the baseline, Δ [95% CI] p
(stats.py), and every cell states its own count where it is fewer than its
row's seeds: `0.4167 (n=1)` (a metric some seeds did not measure is averaged over
those that did, and says so; no ± from one value). Out-of-domain evaluation corpora
(eval.corpora, not in the training data) are marked `(OOD)` in the header.

Columns: `--columns final_bpb,bpb/man,unix_mc/acc` sets the tables' metric columns;
by default table.md shows the swept fields and the headline metrics (`narrow`: loss,
bits per byte, each evaluation corpus's bits per byte), table_full.md every model metric
(report.write_report's `shown`) and table.tex only the headline metric (`final_bpb`,
comparable across tokenizers; `final_loss` where no run measured it), so that it fits
a page: run, the swept fields, the metric, its Δ and n. summary.csv holds all of them.
Headers are readable (`header`, style.readable); a field that does not apply to a row
(`APPLIES_WHEN`: eval.rope_scaling_factor without eval.rope_scaling) prints "-".
"""

from __future__ import annotations

import itertools
import re

from experiments.report import stats as report_stats
from experiments.report.style import readable

EXACT = ("params", "active_params", "kv_bytes_per_token")  # Equal across seeds: no ±.
OOD = " (OOD)"
# Readable metric headers (the csv files and --columns keep the column names).
HEADERS = {
    "final_loss": "loss (nats/token)", "best_loss": "best loss (nats/token)",
    "final_bpb": "bits/byte", "best_bpb": "best bits/byte", "accuracy": "accuracy",
    "tokens": "tokens", "flops": "training FLOPs", "params": "params",
    "active_params": "active params", "kv_bytes_per_token": "KV bytes/token",
    "moe_maxvio": "MoE MaxVio", "tokens_per_s": "tokens/s", "mfu": "MFU",
}
# A field that applies only where another is on: e.g. eval.rope_scaling_factor on a row
# evaluated without eval.rope_scaling prints "-", not its unused 0.0.
APPLIES_WHEN = {
    "eval.rope_scaling_factor": "eval.rope_scaling",
    "model.rope_scaling_factor": "model.rope_scaling",
    "model.experts_per_token": "model.num_experts",
}
_OFF = (None, "", "none", 0, 0.0, False)
NOT_APPLICABLE = "-"


def header(m: str, ood: frozenset = frozenset()) -> str:
  """A metric column's header: "bits/byte", "man bits/byte (OOD)", "loss at 2L"."""
  if m.startswith("bpb/"):
    text = f"{m[len('bpb/'):]} bits/byte"
  elif (at := re.match(r"^(loss|bpb|accuracy)@(\d+L?)$", m)):
    text = f"{HEADERS.get('final_' + at.group(1), at.group(1))} at {at.group(2)}"
  else:
    text = HEADERS.get(m, m)
  return text + (OOD if m in ood else "")


def field_cell(g: dict, f: str) -> str:
  """A swept field's value, or "-" where it does not apply (or was not set)."""
  on = APPLIES_WHEN.get(f)
  if g.get(f) in (None, "") or (on in g and g[on] in _OFF):
    return NOT_APPLICABLE
  return str(g[f])


def headline(metrics: list[str], groups: list[dict]) -> list[str]:
  """table.tex's default metric: bits per byte where measured (comparable across
  tokenizers), else the loss in nats/token."""
  if "final_bpb" in metrics and any(g.get("final_bpb_mean") is not None for g in groups):
    return ["final_bpb"]
  return ["final_loss"]


def narrow(metrics: list[str], groups: list[dict]) -> list[str]:
  """table.md's default metrics: the headline ones (loss, bits per byte, each evaluation
  corpus's bits per byte); table_full.md holds every model metric."""
  keep = ["final_loss", *headline(metrics, groups)]
  keep += [m for m in metrics if m.startswith("bpb/")]
  return [m for m in metrics if m in keep]


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
  head = ["run", *(readable(f) for f in fields)]
  for m in metrics:
    head.append(header(m, ood))
    if report_stats.compared(m):
      head.append(f"Δ {header(m)} [95% CI]")
  body = []
  for g in groups:
    row = [g["label"], *(field_cell(g, f) for f in fields)]
    for m in metrics:
      row.append(cell(g, m))
      if report_stats.compared(m):
        row.append(report_stats.delta_cell(g, m))
    body.append(row + [report_stats.n_cell(g)])
  return head + ["n"], body


def _interactions(groups: list[dict], metrics: list[str],
                  ood: frozenset = frozenset()) -> list[list[str]]:
  """[variant, "A − B", interval] for each row and pair of domains shown; a held-out
  (OOD) corpus is marked."""
  out = []
  for g in groups:
    for a, b in itertools.combinations(report_stats.domains(metrics), 2):
      k = report_stats.interaction_key(a, b)
      if g.get("baseline") and g.get(k) is not None:
        pair = f"{a}{OOD if a in ood else ''} − {b}{OOD if b in ood else ''}"
        out.append([g["label"], pair, report_stats.interval_cell(
            g[k], g[f"{k}_lo"], g[f"{k}_hi"], g[f"p_{k}"])])
  return out


def _legend(groups: list[dict], ood: frozenset, metrics: list[str]) -> str:
  text = report_stats.note(groups)
  if ood & set(metrics):
    text += (" (OOD): an evaluation corpus (eval.corpora) outside the training data.")
  return text.strip()


def markdown(groups: list[dict], fields: list[str], metrics: list[str],
             ood: frozenset = frozenset()) -> str:
  head, body = _table(groups, fields, metrics, ood)
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  lines += ["| " + " | ".join(row) + " |" for row in body]
  text = "\n".join(lines) + "\n"
  ix = _interactions(groups, metrics, ood)
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
  ix = _interactions(groups, metrics, ood)
  if ix:
    lines += ["", "% Domain interaction: (Δ on A) − (Δ on B), 95% CI over seeds",
              *tabular(["run", "domains", "Δ A − Δ B [95% CI]"], ix)]
  legend = _legend(groups, ood, metrics)
  return "\n".join(lines) + "\n" + (f"% {legend}\n" if legend else "")

"""The stability sweep's logits against the lr (experiments/configs/stability.py): per run,
the max attention logit of each layer, measured on held-out text from the run's last
checkpoint (experiments/probes.py), and the output-logit telemetry of its last train line.

    python -m experiments.stability_probe runs/stability        # -> runs/stability/report/
    python -m experiments.stability_probe runs/stability --out DIR

Writes `stability.json` (one record per run: variant, lr, seed, final eval loss or null,
diverged, attention_logit_max per layer, logit_max / logz_mean of the last train line)
and `stability.png` / `.pdf`: three panels against the lr (log axes), one line per
variant, the mean over seeds with each seed as a dot: final eval loss (diverged runs
drawn at their loss at init), the max attention logit over layers, and |log Z| (the mean
log-partition of the output logits, what z-loss pulls to 0).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics

from experiments import probes, report
from experiments.report import sensitivity as report_sensitivity, style as report_style
from train import load_run
from train.metrics import read_metrics

_SUFFIX = re.compile(r"-lr[0-9.e+-]+-s\d+$")


def probe_run(run_dir: str, row: dict, batch: int = 8) -> dict:
  """One run's record (see the module docstring)."""
  kind, loss, init, _ = report_sensitivity.outcome(row)
  out = {"run": row["run"], "variant": _SUFFIX.sub("", os.path.basename(row["run"])),
         "lr": row.get("train.lr"), "seed": row.get("seed"), "status": kind,
         "final_loss": loss, "init_loss": init, "attention_logit_max": None}
  train = [r for r in read_metrics(run_dir, warn=False) if r.get("split") == "train"]
  last = train[-1] if train else {}
  out.update(step=last.get("step"), logit_max=last.get("telemetry/logit_max"),
             logz_mean=last.get("telemetry/logz_mean"))
  try:
    run = load_run(run_dir)
  except FileNotFoundError:
    return out  # No checkpoint (a point that failed before its first): telemetry only.
  seq_len = int(run.config.data.seq_len)
  tokens_BL = probes.text_tokens(run.tokenizer, batch, seq_len,
                                 int(run.config.data.get("num_val_works", 4)))
  out["attention_logit_max"] = probes.attention_logit_max(
      run.model_config, run.variables["params"], tokens_BL)
  out["checkpoint_step"] = run.step
  return out


def probe_sweep(root: str) -> list[dict]:
  _, rows, _ = report.collect(root)
  return [probe_run(os.path.join(root, r["run"]), r) for r in rows
          if r.get("train.lr") is not None and r["status"] in ("finished", "failed")]


def _series(records: list[dict], value) -> dict[str, list[tuple[float, list[float]]]]:
  """{variant: [(lr, [value per seed])]} for the records where value(r) is not None."""
  out: dict[str, dict[float, list[float]]] = {}
  for r in records:
    v = value(r)
    if v is not None and math.isfinite(v):
      out.setdefault(r["variant"], {}).setdefault(r["lr"], []).append(v)
  return {k: sorted(d.items()) for k, d in out.items()}


def plot(records: list[dict], path: str) -> None:
  plt = report_style.pyplot()
  if plt is None:
    return
  panels = [("final eval loss (nats/token)",
             lambda r: r["final_loss"] if r["status"] == "loss" else r["init_loss"]),
            ("max attention logit",
             lambda r: max(r["attention_logit_max"]) if r["attention_logit_max"] else None),
            ("|log Z| (output)", lambda r: abs(r["logz_mean"]) if r["logz_mean"] else None)]
  variants = list(dict.fromkeys(r["variant"] for r in records))
  with plt.rc_context(report_style.PAPER_STYLE):
    fig, axes = plt.subplots(1, 3, figsize=(7.0, 2.2))
    for ax, (label, value) in zip(axes, panels):
      for variant, series in _series(records, value).items():
        colour = f"C{variants.index(variant) % 10}"
        for lr, vs in series:
          ax.plot([lr] * len(vs), vs, ".", color=colour, alpha=0.4, ms=3)
        ax.plot([lr for lr, _ in series], [statistics.fmean(vs) for _, vs in series], "-o",
                color=colour, ms=3, label=variant if ax is axes[0] else None)
      ax.set_xscale("log")
      if label == panels[1][0]:
        ax.set_yscale("log")
      ax.set(xlabel="learning rate", ylabel=label)
      ax.grid(alpha=0.3, which="both")
    bad = [(r["lr"], r["init_loss"]) for r in records if r["status"] == "diverged"]
    if bad:
      axes[0].plot(*zip(*bad), "kx", ms=5, label="diverged (loss at init)")
    fig.legend(loc="lower center", ncol=len(variants) + 1, bbox_to_anchor=(0.5, 1.0))
    fig.tight_layout()
    for p in (path, os.path.splitext(path)[0] + ".pdf"):
      fig.savefig(p, bbox_inches="tight", dpi=200)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m experiments.stability_probe",
                                   description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("root", help="the stability sweep's directory")
  parser.add_argument("--out", default=None, help="output directory (default: ROOT/report)")
  args = parser.parse_args(argv)
  out = args.out or os.path.join(args.root, "report")
  os.makedirs(out, exist_ok=True)
  records = probe_sweep(args.root)
  with open(os.path.join(out, "stability.json"), "w") as f:
    json.dump(records, f, indent=1)
  plot(records, os.path.join(out, "stability.png"))
  print(f"stability  {os.path.join(out, 'stability.json')}, {os.path.join(out, 'stability.png')}")


if __name__ == "__main__":
  main()

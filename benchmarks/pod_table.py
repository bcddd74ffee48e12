"""The pod table of docs/PERFORMANCE.md: each pod preset compiled for the topologies it
would train on (`launch.py --mode compile`, one subprocess per row), then one markdown
table: fits, per-chip HBM, roofline step time and MFU ESTIMATES, collective bytes.

    python -m benchmarks.pod_table --out pod_table.json [--rows 8b@v6e-256,...] [--cache DIR]

Each row's JSON report is kept in --cache (default runs/pod_table/) and reused when its
command has not changed, so a rerun only compiles new or changed rows (a large row takes
minutes of CPU). Rows run one at a time (a subprocess each, at this process's niceness:
run it under `nice` on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (preset, topology, sequences per chip): the sizes a user would book for each model.
# In the order they run: the rows compared with MaxText's published MFUs come early.
ROWS = (("125m", "v5e-16", 16), ("8b", "v6e-256", 2), ("moe", "v5p-64", 8),
        ("1b", "v5e-16", 8), ("mla", "v5p-64", 8), ("1b", "v5p-64", 8),
        ("8b", "v5p-1024", 1), ("moe", "v6e-256", 4))
GiB = 1024 ** 3


def command(preset: str, topology: str, per_chip: int, out: str) -> list[str]:
  from train.aot.topology import parse_topology  # pylint: disable=g-import-not-at-top
  batch = per_chip * parse_topology(topology).num_chips
  return ["launch.py", "--mode", "compile", "--config",
          f"experiments/configs/pod.py:preset={preset},batch={batch}", "--topology", topology,
          "--compile_steps", "train", "--out", out]


def cached(row, cache: str) -> dict | None:
  """The row's report from an earlier run of the same command, if there is one."""
  out = os.path.join(cache, f"{row[0]}-{row[1]}.json")
  if os.path.exists(out):
    with open(out) as f:
      report = json.load(f)
    if report.get("command") == command(*row, out):
      return report
  return None


def run_row(row, cache: str) -> dict:
  preset, topology, per_chip = row
  out = os.path.join(cache, f"{preset}-{topology}.json")
  cmd = command(preset, topology, per_chip, out)
  if (report := cached(row, cache)) is not None:
    return report
  print(f"compiling: python {' '.join(cmd)}", flush=True)
  t0 = time.time()
  proc = subprocess.run([sys.executable, *cmd], cwd=ROOT, text=True,
                        capture_output=True, check=False)
  if proc.returncode not in (0, 2) or not os.path.exists(out):  # 2: does not fit.
    tail = (proc.stdout + proc.stderr)[-2000:]
    return {"command": cmd, "error": tail}
  with open(out) as f:
    report = json.load(f)
  report.update(command=cmd, wall_s=round(time.time() - t0, 1), load=os.getloadavg())
  with open(out, "w") as f:
    json.dump(report, f, indent=1)
  print(proc.stdout, flush=True)
  return report


def markdown(reports: list[dict]) -> str:
  head = ("| model | topology | mesh | batch x seq | fits | HBM per chip (args + temps) "
          "| step time (est.) | bound | MFU (est.; no overlap) | collectives per chip |\n"
          "|---|---|---|---|---|---|---|---|---|---|")
  lines = [head]
  for r in reports:
    if "error" in r:
      lines.append(f"| `{r['command'][4]}` | {r['command'][6]} | compile failed: "
                   f"{r['error'].strip().splitlines()[-1][:120]} | | | | | | | |")
      continue
    t = r["steps"]["train"]
    m = t["memory"]
    mesh = " ".join(f"{k}={v}" for k, v in r["mesh"].items() if v > 1)
    fits = "yes" if t["fits"] else f"no (+{(m['total'] - t['hbm_bytes']) / GiB:.1f} GiB)"
    if not t["fits"] and "remat_full" in r:
      fits += "; remat=full " + ("fits" if r["remat_full"]["fits"] else "does not")
    est = t if "roofline" in t else r.get("remat_full", {})  # remat=full's, if only it fits.
    where = "" if est is t else " (remat=full)"
    roof = est.get("roofline")
    speed = (f"{roof['step_time_s'] * 1e3:.0f} ms{where} | {roof['bound']} | "
             f"{est['mfu_estimate']:.0%}; {est['mfu_estimate_serial']:.0%}" if roof
             else "n/a | | ")
    comm = est.get("collectives", t.get("collectives"))
    comm = f"{comm['total']['wire_bytes'] / GiB:.2f} GiB" if comm else "n/a"
    lines.append(
        f"| {r['config']} ({r['params'] / 1e9:.2f}B, remat={r['remat']}) | {r['topology']} "
        f"({r['chips']} chips) | {mesh} | {t['shapes']['batch']} x {t['shapes']['length']} "
        f"| {fits} | {m['total'] / GiB:.1f} GiB ({m['arguments'] / GiB:.1f} + "
        f"{m['temporaries'] / GiB:.1f}) of {t['hbm_bytes'] / GiB:.1f} | {speed} | {comm} |")
  lines += ["", "Commands (each row's `launch.py --mode compile`; JSON in `runs/pod_table/`):", ""]
  lines += [f"- `python {' '.join(_shown(r['command']))}`" + (
      f" ({r['wall_s'] / 60:.0f} min wall at load {r['load'][0]:.0f} on this host)"
      if "wall_s" in r else "") for r in reports]
  return "\n".join(lines)


BEGIN, END = "<!-- pod-table: python -m benchmarks.pod_table --docs FILE -->", "<!-- /pod-table -->"


def write_docs(path: str, cache: str) -> None:
  """The cached rows as the table; rows not compiled yet are listed with their commands."""
  done = [r for r in (cached(row, cache) for row in ROWS) if r is not None]
  missing = [row for row in ROWS if cached(row, cache) is None]
  text = markdown(done) if done else "(no row compiled yet)"
  if missing:
    text += ("\n\nNot compiled yet (each is minutes of CPU; run `benchmarks.pod_table` "
             "to add them):\n\n" + "\n".join(
                 f"- `python {' '.join(_shown(command(*row, 'x')))}`" for row in missing))
  with open(path) as f:
    page = f.read()
  head, rest = page.split(BEGIN, 1)
  _, tail = rest.split(END, 1)
  with open(path, "w") as f:
    f.write(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def _shown(cmd: list[str]) -> list[str]:
  """The command without its --out (a path of this machine)."""
  i = cmd.index("--out")
  return cmd[:i] + cmd[i + 2:]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default="pod_table.json")
  parser.add_argument("--cache", default=os.path.join(ROOT, "runs", "pod_table"))
  parser.add_argument("--rows", default="", help="preset@topology,... (default: all ROWS)")
  parser.add_argument("--docs", default="", help="rewrite this page's table (between "
                      f"{BEGIN} and {END}) from the cache; compiles nothing")
  args = parser.parse_args()
  if args.docs:
    write_docs(args.docs, args.cache)
    return
  rows = ROWS
  if args.rows:
    wanted = set(args.rows.split(","))
    rows = tuple(r for r in ROWS if f"{r[0]}@{r[1]}" in wanted)
  os.makedirs(args.cache, exist_ok=True)
  reports = [run_row(r, args.cache) for r in rows]
  table = markdown(reports)
  print(table)
  with open(args.out, "w") as f:
    json.dump({"rows": reports, "markdown": table}, f, indent=1)


if __name__ == "__main__":
  sys.path.insert(0, ROOT)
  main()

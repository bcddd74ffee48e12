"""The CPU-scale scaling ladder of docs/compute_matched.md, timed end to end.

    python -m benchmarks.ladder --out ladder.json [--workdir runs/ladder] [--arg ARG]

Runs `launch.py --sweep` on experiments/configs/ladder.py (default ARG: 3 sizes x MHA /
MQA x 2 seeds, 2 tokens per parameter, a decay branch at half of each budget), then
`python -m experiments.report`, as docs/compute_matched.md says. Prints and writes
the sweep's and the report's wall times, the load average before and after, the
machine, and the report's fits (fits.json) and table (table.md). Re-running with the
same --workdir skips finished points (a resumed timing then measures only the rest).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARG = "sizes=xs+s+m,variants=mha+mqa,seeds=2,tpp=2,budgets=0.5,min_steps=10"


def _timed(cmd: list[str]) -> float:
  t0 = time.time()
  subprocess.run(cmd, check=True, cwd=ROOT)
  return time.time() - t0


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--out", required=True, help="JSON file to write")
  parser.add_argument("--workdir", default="runs/ladder_bench")
  parser.add_argument("--arg", default=ARG, help="ladder.py's config argument")
  args = parser.parse_args(argv)
  load_start = os.getloadavg()
  sweep_s = _timed([sys.executable, "launch.py", "--config",
                    f"experiments/configs/ladder.py:{args.arg}", "--workdir", args.workdir,
                    "--sweep", "--config.train.tensorboard=False"])
  report_s = _timed([sys.executable, "-m", "experiments.report", args.workdir])
  report = os.path.join(ROOT, args.workdir, "report")
  fits_path = os.path.join(report, "fits.json")
  with open(os.path.join(report, "table.md")) as f:
    table = f.read()
  fits = None
  if os.path.exists(fits_path):
    with open(fits_path) as f:
      fits = json.load(f)
  out = {"arg": args.arg, "sweep_s": sweep_s, "report_s": report_s,
         "load_avg_start": load_start, "load_avg_end": os.getloadavg(),
         "cpu_count": os.cpu_count(), "table_md": table,
         "fits": fits}
  with open(args.out, "w") as f:
    json.dump(out, f, indent=1)
  print(f"ladder {args.arg}: sweep {sweep_s / 60:.1f} min, report {report_s:.0f} s, load "
        f"{load_start[0]:.1f} -> {out['load_avg_end'][0]:.1f} on {os.cpu_count()} cores")
  print(table)
  return out


if __name__ == "__main__":
  main()

"""Goodput under preemption: a run SIGKILLed every `--kill_every` seconds and restarted
with the same command until it finishes, its time read back from its goodput ledger
(RUN/goodput.jsonl, train/lifecycle/goodput.py) and set against the harness's own clock.

  python -m benchmarks.preemption --kill_every 60 --checkpoint_every 50 --out preemption.json

The run is `make train`'s (experiments/configs/tiny.py; `--config` for another) through
launch.py in a subprocess, its run directory in a bucket: a moto S3 server on localhost
started here as the tests start it (tests/storage_servers.py; `--where local`: a local
directory instead). Two settings, each a run of its own: persistent checkpoints every
`--checkpoint_every` steps only, then with the local tier every `--local_every` steps too
(train/local_checkpoint.py). Each attempt is killed `--kill_every` seconds after it was
started (at most `--max_kills` times; benchmarks/preemption_loss.py's harness), or at its
first ledger record if that comes later (on a loaded machine start-up can outlast the
interval: the run would never progress, and a killed attempt without a record is not in
the ledger's wall time). For each:
goodput and its breakdown, and the ledger's wall time (first process start to its last
record; the categories sum to it) against the measured wall (the first start to the last
exit: it also holds the last process's exit after its last record).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time

from benchmarks.preemption_loss import ROOT, machine, run_attempt
from train.io import runlog
from train.lifecycle import goodput


def _command(workdir: str, args, local_every: int, local_dir: str) -> list[str]:
  steps = [f"--config.train.steps={args.steps}"] if args.steps else []
  return [sys.executable, os.path.join(ROOT, "launch.py"), "--config", args.config,
          "--workdir", workdir, *steps,
          f"--config.train.checkpoint_every={args.checkpoint_every}",
          f"--config.train.local_checkpoint_every={local_every}",
          f"--config.train.local_checkpoint_dir={local_dir}", "--config.train.tensorboard=False",
          "--verbosity=-1", *args.extra.split()]


class _Due:
  """Whether to kill the attempt started at `started`: `kill_every` s after it, once it
  has a ledger record (the ledger is read once a second from then on)."""

  def __init__(self, workdir: str, started: float, kill_every: float):
    self.workdir, self.started, self.kill_every, self.polled = (
        workdir, started, kill_every, 0.0)

  def __call__(self) -> bool:
    now = time.time()
    if now - self.started < self.kill_every or now - self.polled < 1.0:
      return False
    self.polled = now
    # The kernel's start time is in clock ticks (10 ms), rounded down.
    return any(r.get("start", 0) >= self.started - 1.0
               for r in runlog.read_records(self.workdir, goodput.GOODPUT_FILE, warn=False))


def measure(workdir: str, cmd: list[str], kill_every: float, max_kills: int,
            log_path: str) -> dict:
  """Runs `cmd` to the end, killing each attempt `kill_every` s after its start (or at
  its first ledger record, if later: one killed before it could train would leave no
  record and make no progress)."""
  t0, kills = time.time(), 0
  while True:
    due = _Due(workdir, time.time(), kill_every)
    code = run_attempt(cmd, log_path, lambda: kills < max_kills and due(), timeout=3600)
    if code is None:
      kills += 1
      continue
    if code != 0:
      raise RuntimeError(f"an attempt exited with {code}; see {log_path}")
    break
  measured = time.time() - t0
  g = goodput.summary(workdir)
  total = sum(g.seconds.values())
  return {"kills": kills, "attempts": len(g.attempts), "measured_wall_s": measured,
          "ledger_wall_s": g.wall_s, "breakdown_sum_s": total,
          "sum_vs_measured_pct": 100 * (total - measured) / measured,
          "goodput": g.goodput, "seconds": g.seconds, "fractions": g.fractions(),
          "steps": g.steps}


def _text(name: str, r: dict) -> str:
  parts = ", ".join(f"{k} {v:.1f} s" for k, v in r["seconds"].items())
  return (f"{name}: goodput {100 * r['goodput']:.1f}% over {r['attempts']} attempts "
          f"({r['kills']} kills); {parts}; steps {r['steps']}; ledger "
          f"{r['breakdown_sum_s']:.1f} s vs measured {r['measured_wall_s']:.1f} s "
          f"({r['sum_vs_measured_pct']:+.2f}%)")


@contextlib.contextmanager
def _bucket(where: str):
  """A root for the run directories: a fresh bucket on a local moto S3 server, or a
  local temporary directory."""
  if where == "local":
    root = tempfile.mkdtemp(prefix="goodput-")
    try:
      yield root
    finally:
      shutil.rmtree(root, ignore_errors=True)
    return
  import s3fs  # pylint: disable=g-import-not-at-top
  from tests.storage_servers import moto_s3  # pylint: disable=g-import-not-at-top
  with moto_s3():
    s3fs.S3FileSystem().mkdir("goodput")
    yield "s3://goodput"


def main(argv: list[str] | None = None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--config", default=os.path.join(ROOT, "experiments/configs/tiny.py"))
  ap.add_argument("--steps", type=int, default=0, help="train.steps (0: the config's)")
  ap.add_argument("--checkpoint_every", type=int, default=50)
  ap.add_argument("--local_every", type=int, default=5)
  ap.add_argument("--kill_every", type=float, default=60.0)
  ap.add_argument("--max_kills", type=int, default=1000)
  ap.add_argument("--where", choices=("s3", "local"), default="s3")
  ap.add_argument("--extra", default="", help="more launch.py flags, space-separated")
  ap.add_argument("--out", default="")
  args = ap.parse_args(argv)
  result = {"machine": machine(), "load_before": os.getloadavg(), "args": vars(args)}
  scratch = tempfile.mkdtemp(prefix="goodput-local-")  # Kept if a run fails: its log.
  with _bucket(args.where) as root:
    for name, local_every in (("persistent_only", 0), ("with_local_tier", args.local_every)):
      workdir = f"{root}/{name}"
      cmd = _command(workdir, args, local_every, os.path.join(scratch, name))
      result[name] = measure(workdir, cmd, args.kill_every, args.max_kills,
                             os.path.join(scratch, "attempts.log"))
      print(_text(name, result[name]), flush=True)
  shutil.rmtree(scratch, ignore_errors=True)
  result["load_after"] = os.getloadavg()
  text = json.dumps(result, indent=2)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text + "\n")
  else:
    print(text)
  return result


if __name__ == "__main__":
  main()

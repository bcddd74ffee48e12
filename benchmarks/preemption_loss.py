"""Work lost per preemption, with and without the local checkpoint tier
(train/local_checkpoint.py): steps trained again after each SIGKILL.

  python -m benchmarks.preemption_loss --out preemption_loss.json

One run directory per setting (the smoke model, experiments/configs/tiny.py:smoke,
through launch.py in a subprocess), killed with SIGKILL once its metrics.jsonl reaches
each of a fixed set of steps, then re-launched with the same command; the run ends at
train.steps. For each kill: the last step logged before it, the step the next attempt
resumed from (its first metrics line's step - 1) and their difference, the steps redone.
Persistent checkpoints every `--checkpoint_every` steps in both settings; local ones
every `--local_every` in the second. Steps redone are bounded by the interval of the
newest tier that survives the kill: here, the same host, the local one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KILLS = (17, 33, 58, 79, 104)  # Fixed, off every checkpoint interval used.


def _lines(workdir: str, name: str = "metrics.jsonl") -> list[dict]:
  """The train lines of RUN/`name` (a line cut by a kill is skipped)."""
  path = os.path.join(workdir, name)
  if not os.path.exists(path):
    return []
  out = []
  with open(path) as f:
    for line in f:
      try:
        r = json.loads(line)
      except ValueError:
        continue
      if r.get("split") == "train":
        out.append(r)
  return out


def _command(workdir: str, steps: int, every: int, local_every: int, local_dir: str):
  return [sys.executable, os.path.join(ROOT, "launch.py"), "--config",
          os.path.join(ROOT, "experiments/configs/tiny.py:smoke"), "--workdir", workdir,
          f"--config.train.steps={steps}", "--config.train.log_every=1",
          f"--config.train.checkpoint_every={every}", "--config.train.tensorboard=False",
          f"--config.train.local_checkpoint_every={local_every}",
          f"--config.train.local_checkpoint_dir={local_dir}", "--verbosity=-1"]


def _last_step(workdir: str) -> int:
  lines = _lines(workdir)
  return lines[-1]["step"] if lines else 0


def run_attempt(cmd: list[str], log_path: str, kill_when, timeout: float = 600
                ) -> int | None:
  """Runs `cmd` (its stderr appended to `log_path`) until it exits, or SIGKILLs it as
  soon as `kill_when()` is true (polled every 5 ms); its exit status, None if killed."""
  with open(log_path, "a") as err:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.time() + timeout
    while proc.poll() is None and time.time() < deadline:
      if kill_when():
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return None
      time.sleep(0.005)
    return proc.wait()


def _attempt(cmd, workdir: str, kill_at: int | None, timeout: float = 600) -> dict:
  """One attempt, SIGKILLed once it logs a step >= `kill_at` (None: runs to the end).
  What it resumed from: the first of the lines its resume moved to
  metrics.rewound.jsonl, less one (none moved: the step the last attempt logged)."""
  before, rewound = _last_step(workdir), len(_lines(workdir, "metrics.rewound.jsonl"))
  run_attempt(cmd, os.path.join(os.path.dirname(workdir), "attempts.log"),
              lambda: kill_at is not None and _last_step(workdir) >= max(kill_at, before + 1),
              timeout)
  moved = [r["step"] for r in _lines(workdir, "metrics.rewound.jsonl")[rewound:]]
  return {"resumed_from": min(moved) - 1 if moved else before, "reached": _last_step(workdir)}


def measure(steps: int, every: int, local_every: int) -> dict:
  """Kills one run at each of KILLS; the steps each resume trained again."""
  base = tempfile.mkdtemp(prefix="preemption-")
  workdir, local_dir = os.path.join(base, "run"), os.path.join(base, "local")
  cmd = _command(workdir, steps, every, local_every, local_dir)
  kills, killed_after = [], None
  for target in (*KILLS, None):
    got = _attempt(cmd, workdir, target)
    if killed_after is not None:
      kills.append({"killed_after_step": killed_after, "resumed_from": got["resumed_from"],
                    "steps_redone": killed_after - got["resumed_from"]})
    killed_after = got["reached"]
  assert killed_after == steps, (f"the last attempt ended at step {killed_after}; see "
                                 f"{base}/attempts.log")
  shutil.rmtree(base)
  return {"checkpoint_every": every, "local_checkpoint_every": local_every, "kills": kills,
          "max_steps_redone": max(k["steps_redone"] for k in kills),
          "mean_steps_redone": sum(k["steps_redone"] for k in kills) / len(kills)}


def machine() -> str:
  """The machine line of a benchmark's JSON: architecture, CPUs, CPU model."""
  return f"{platform.machine()}, {os.cpu_count()} CPUs, {_cpu_model()}"


def _cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      return next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
  except (OSError, StopIteration):
    return platform.processor()


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--steps", type=int, default=120)
  ap.add_argument("--checkpoint_every", type=int, default=40)
  ap.add_argument("--local_every", type=int, default=5)
  ap.add_argument("--out", default="")
  args = ap.parse_args()
  result = {"machine": machine(),
            "kills_at": list(KILLS), "steps": args.steps,
            "persistent_only": measure(args.steps, args.checkpoint_every, 0),
            "with_local_tier": measure(args.steps, args.checkpoint_every, args.local_every)}
  text = json.dumps(result, indent=2)
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  main()

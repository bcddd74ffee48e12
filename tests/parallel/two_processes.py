"""Runs two `jax.distributed` CPU processes on localhost for a test.

A hang shows where it hangs, and start-up races of the test harness itself are
retried once (with a warning carrying the logs), not reported as a failure:
- The coordinator port is picked by binding port 0 and closing it; until process 0
  binds it again, another process (a gloo pair of a concurrent test, any ephemeral
  connection) may take it. Process 0 then dies ("Failed to add port") and process 1
  waits for a coordinator that never comes.
- Under two pytest-xdist workers on 2 cores the pair hung once for 120 s at 8 s of
  work (jaxlib 0.10.2; not reproduced in 48 stressed runs outside the suite).
A real failure (an error, a wrong result) fails on the first attempt; only a run that
times out, or dies before process 0 serves the coordinator, is retried.
"""

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import warnings
from typing import Callable, Sequence

REPO = pathlib.Path(__file__).resolve().parents[2]
_PORT_LOST = "Failed to add port"


def free_port() -> int:
  """A port free for the coordinator's own bind address, `[::]:port` (all addresses)."""
  try:
    with socket.socket(socket.AF_INET6) as s:
      s.bind(("::", 0))
      return s.getsockname()[1]
  except OSError:  # No IPv6: the coordinator falls back to IPv4 too.
    with socket.socket() as s:
      s.bind(("", 0))
      return s.getsockname()[1]


def cpu_env(devices_per_process: int) -> dict[str, str]:
  """The environment of each process: CPU, no cluster detection, no persistent cache.

  The cache is off: its keys differ per process and only process 0 writes it, so one
  process would load programs while the other compiles them, and gloo gives up when one
  process reaches a collective 30 s after the other. PYTHONFAULTHANDLER makes the
  SIGABRT sent to a hung process print every thread's Python stack to its log.
  """
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO), PYTHONFAULTHANDLER="1",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_process}",
             JAX_ENABLE_COMPILATION_CACHE="false")
  for key in ("SLURM_NTASKS", "TPU_WORKER_HOSTNAMES", "OMPI_COMM_WORLD_SIZE"):
    env.pop(key, None)
  return env


def attempt(argv: Callable[[int, int], Sequence[str]], env: dict[str, str] | list[dict],
            logs: list[pathlib.Path], timeout_s: float) -> tuple[list[int | None], bool]:
  """One run of both processes: their return codes and whether it timed out. `env`:
  both processes' environment, or a list of one per process (e.g. `cpu_env(4)` with a
  fault injected into one)."""
  envs = env if isinstance(env, list) else [env] * len(logs)
  port = free_port()
  procs = []
  try:
    for i, log_path in enumerate(logs):
      with open(log_path, "w") as log:  # Files: a full pipe would block the process.
        procs.append(subprocess.Popen([sys.executable, *argv(i, port)], env=envs[i], cwd=REPO,
                                      stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    for p in procs:
      try:
        p.wait(timeout=max(1.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        break
  finally:
    hung = [p for p in procs if p.poll() is None]
    for p in hung:
      p.send_signal(signal.SIGABRT)  # The faulthandler prints the stacks, then it dies.
    for p in hung:
      try:
        p.wait(timeout=10)
      except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
  return [p.returncode for p in procs], bool(hung)


def run(argv: Callable[[int, int], Sequence[str]], logdir: pathlib.Path,
        devices_per_process: int = 4, timeout_s: float = 120) -> list[pathlib.Path]:
  """Runs `python *argv(process_id, port)` as processes 0 and 1; their logs.

  Fails the test with both logs unless both exit 0. A run that timed out, or whose
  process 0 lost the coordinator port, is retried once with a fresh port.
  """
  env = cpu_env(devices_per_process)
  report = ""
  for n in range(2):
    logs = [logdir / f"process{i}.attempt{n}.log" for i in range(2)]
    codes, timed_out = attempt(argv, env, logs, timeout_s)
    texts = [log.read_text() for log in logs]
    report = "\n".join(f"--- process {i} exited {code} ---\n{text[-6000:]}"
                       for i, (code, text) in enumerate(zip(codes, texts)))
    if codes == [0, 0]:
      return logs
    if not (timed_out or _PORT_LOST in texts[0]) or n == 1:
      break
    warnings.warn(f"two-process run {'timed out' if timed_out else 'lost its port'}; "
                  f"retrying once with a new port:\n{report}")
  raise AssertionError(f"the two processes did not both succeed:\n{report}")

"""Runs `launch.py` the way a user does, in this process (no interpreter start-up).

    from tests.cli import launch
    out = launch("--config", "experiments/configs/tiny.py:smoke", "--workdir", str(d))

Parses the arguments with launch.py's own absl flags (sys.argv too: ml_collections
reads `--config.x=y` overrides from it), runs `launch.main`, and returns what it
printed to stdout. A `SystemExit` with a non-zero code, or any exception, propagates
with what was printed before it as its `stdout` attribute.
Exit paths that end the interpreter (flushing async checkpoints at exit, signals)
need a real subprocess: `run_cli` runs one, `launch_cmd` builds its command line.

    done = run_cli("--workdir", str(d), "--config.train.lr=-1")  # CompletedProcess
    assert done.returncode == 1 and "error:" in done.stderr

`run_cli` fails the test, naming the command and the end of its output, when the process
died of a signal or aborted (exit 134: a compiler CHECK failure, `F hlo_instruction.cc`):
an abort is never a refusal, whatever the test expected of the exit status.
"""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import signal
import subprocess
import sys
from unittest import mock

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.path.join(ROOT, "experiments", "configs", "tiny.py:smoke")


def _with_config(args: tuple[str, ...]) -> list[str]:
  """ml_collections registers `--config.x` overrides only when --config is parsed."""
  has = any(a == "--config" or a.startswith("--config=") for a in args)
  return list(args) if has else ["--config", SMOKE, *args]


def launch(*args: str) -> str:
  import launch as launch_module  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  argv = [os.path.join(ROOT, "launch.py"), *_with_config(args)]
  out = io.StringIO()
  with mock.patch.object(sys, "argv", argv), contextlib.redirect_stdout(out):
    for name in [n for n in flags.FLAGS if n.startswith("config.")]:
      delattr(flags.FLAGS, name)  # Overrides of an earlier call: registered per parse.
    flags.FLAGS.unparse_flags()
    flags.FLAGS(argv)
    try:
      launch_module.main([])
    except BaseException as e:
      e.stdout = out.getvalue()
      raise
    finally:
      flags.FLAGS.unparse_flags()
  return out.getvalue()


def launch_cmd(*args: str) -> list[str]:
  """The same command line for subprocess.run / Popen."""
  return [sys.executable, os.path.join(ROOT, "launch.py"), *_with_config(args)]


# 128 + SIGABRT: what a shell reports for a process that abort()ed (XLA's CHECK failures).
_ABORT = 128 + signal.SIGABRT


def crashed(returncode: int) -> bool:
  """Killed by a signal (negative under subprocess) or an abort's 134: not an answer."""
  return returncode < 0 or returncode == _ABORT


def fail_if_crashed(cmd: list[str], returncode: int, output: str, lines: int = 30) -> None:
  if crashed(returncode):
    tail = "\n".join(output.splitlines()[-lines:])
    pytest.fail(f"the command crashed (exit {returncode}), not a refusal:\n  "
                f"{shlex.join(cmd)}\nlast lines of its output:\n{tail}", pytrace=False)


def run_cli(*args: str, timeout: float = 300, cwd: str | None = None,
            env: dict | None = None, cmd: list[str] | None = None
            ) -> subprocess.CompletedProcess:
  """`launch.py *args` (or `cmd`) in a subprocess, text output captured; a crash fails
  the test (see the module docstring)."""
  cmd = cmd or launch_cmd(*args)
  done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                        env=env)
  fail_if_crashed(cmd, done.returncode, done.stdout + done.stderr)
  return done

"""Runs `launch.py` the way a user does, in this process (no interpreter start-up).

    from tests.cli import launch
    out = launch("--config", "experiments/configs/tiny.py:smoke", "--workdir", str(d))

Parses the arguments with launch.py's own absl flags (sys.argv too: ml_collections
reads `--config.x=y` overrides from it), runs `launch.main`, and returns what it
printed to stdout. A `SystemExit` with a non-zero code, or any exception, propagates
with what was printed before it as its `stdout` attribute.
Exit paths that end the interpreter (flushing async checkpoints at exit, signals)
need a real subprocess: `launch_cmd` builds its command line.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from unittest import mock

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

"""Process settings that must be in place before the interpreter starts: glibc's malloc.

XLA:CPU allocates each execution's temporaries as one block (hundreds of MiB for a
train step) and frees it afterwards. glibc serves a block that large with a fresh
mmap, so every step page-faults and zeroes all of it again in 4 KiB pages. With
`glibc.malloc.hugetlb=1` malloc asks for transparent huge pages on such blocks
(`madvise`), and almost all of those faults go (the measured faults, kernel time and
step times: docs/PERFORMANCE.md, "What made it faster", first round, item 5).

glibc reads its tunables once, at process start, so the entry points (launch.py,
benchmarks/run.py) call `reexec_with_malloc_tuning()` first: when the variable is
unset it sets it and replaces the process with the same command line (same pid,
nothing has run yet). It does nothing where it cannot matter (not Linux with glibc
>= 2.35) and never overrides a GLIBC_TUNABLES the user set; BLOCKWORK_MALLOC_TUNING=0
turns it off.
"""

from __future__ import annotations

import os
import platform
import sys

TUNABLES = "glibc.malloc.hugetlb=1"
OPT_OUT = "BLOCKWORK_MALLOC_TUNING"


def malloc_tuning_applies(environ=os.environ) -> bool:
  """True where re-executing would change the allocator: Linux, glibc >= 2.35 (where
  `glibc.malloc.hugetlb` exists), no GLIBC_TUNABLES of the user's, no opt-out."""
  if sys.platform != "linux" or environ.get(OPT_OUT, "1") == "0":
    return False
  if "GLIBC_TUNABLES" in environ:
    return False
  lib, version = platform.libc_ver()
  try:
    major, minor = (int(p) for p in version.split(".")[:2])
  except ValueError:
    return False
  return lib == "glibc" and (major, minor) >= (2, 35)


def reexec_with_malloc_tuning() -> None:
  """Replaces this process with itself under GLIBC_TUNABLES=TUNABLES, where it applies.

  Call it first in a `__main__` block, before anything is computed: the command line is
  `sys.orig_argv` (so `python -m benchmarks.run ...` stays a module run).
  """
  if not malloc_tuning_applies():
    return
  os.environ["GLIBC_TUNABLES"] = TUNABLES
  sys.stdout.flush()
  sys.stderr.flush()
  os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


# libtpu, once installed (the `aot` extra), makes JAX probe for an attached TPU the first
# time a backend starts; on a host without one that prints "Failed to find host bounds",
# INVALID_ARGUMENT and a "Source Location Trace" on every run. Device nodes that mean an
# accelerator is attached: TPU VMs expose /dev/accel* (v4, v5e, v6e) or /dev/vfio/N
# (v5p); GPU hosts /dev/nvidia*; then JAX's own platform search is left alone.
ACCELERATOR_NODES = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*")


def _mode(argv: list[str]) -> str:
  for i, arg in enumerate(argv):
    if arg.startswith("--mode="):
      return arg.partition("=")[2]
    if arg == "--mode" and i + 1 < len(argv):
      return argv[i + 1]
  return "train"


def default_platforms(argv: list[str], environ=os.environ, nodes=None) -> str | None:
  """"cpu" where JAX should not look for accelerators: no JAX_PLATFORMS of the user's,
  no accelerator device node, and a mode other than `compile` (which sets up its own
  compile-only TPU topology: train/aot/topology.py prepare_host). None: leave it."""
  import glob  # pylint: disable=g-import-not-at-top
  if environ.get("JAX_PLATFORMS") or _mode(argv) == "compile":
    return None
  found = nodes if nodes is not None else [p for pat in ACCELERATOR_NODES
                                           for p in glob.glob(pat)]
  return None if found else "cpu"


def quiet_backend_default(argv: list[str] | None = None) -> None:
  """Sets JAX_PLATFORMS=cpu per `default_platforms`: call before JAX starts a backend."""
  platforms = default_platforms(sys.argv if argv is None else argv)
  if platforms:
    os.environ["JAX_PLATFORMS"] = platforms


START_ENV = "BLOCKWORK_PROCESS_START"  # "pid:time": launch.py's process start (goodput).


def mark_process_start(t: float) -> None:
  """launch.py's first step: its process start `t`, for the run's goodput ledger
  (train/lifecycle/goodput.py). Kept through the re-exec above (same pid); a child process (a
  sweep's point) marks its own."""
  if os.environ.get(START_ENV, "").partition(":")[0] != str(os.getpid()):
    os.environ[START_ENV] = f"{os.getpid()}:{t}"

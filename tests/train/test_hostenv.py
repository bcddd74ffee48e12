"""launch.py and benchmarks/run.py re-execute under glibc's huge-page malloc
(train/hostenv.py): XLA:CPU's per-step temporaries then stop page-faulting."""

import os
import subprocess
import sys

import pytest

from train import hostenv

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A program whose 68 MiB of temporaries glibc serves with a fresh mmap on every run.
PROGRAM = """
import os, resource, jax, jax.numpy as jnp
from train.hostenv import reexec_with_malloc_tuning
reexec_with_malloc_tuning()
f = jax.jit(lambda x: jnp.cumsum(jnp.cumsum(jnp.sin(x), axis=0), axis=1)).lower(
    jnp.ones((4096, 4096))).compile()
x = jnp.ones((4096, 4096))
f(x).block_until_ready()
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(2):
  f(x).block_until_ready()
print(os.environ.get("GLIBC_TUNABLES"), (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) / 2)
"""


def _run(**env) -> tuple[str, float]:
  # One device at the default optimisation level (not the suite's 8 devices at -O0).
  full = {k: v for k, v in os.environ.items()
          if k not in ("GLIBC_TUNABLES", hostenv.OPT_OUT, "XLA_FLAGS")}
  out = subprocess.run([sys.executable, "-c", PROGRAM], cwd=ROOT, env={**full, **env},
                       capture_output=True, text=True, timeout=300, check=True)
  tunables, faults = out.stdout.split()
  return tunables, float(faults)


def _thp_available() -> bool:
  try:
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
      return "[never]" not in f.read()
  except OSError:
    return False


def test_tuning_applies_only_where_the_user_left_it_to_us():
  """A user's own GLIBC_TUNABLES is never replaced; the opt-out is honoured."""
  assert not hostenv.malloc_tuning_applies({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
  assert not hostenv.malloc_tuning_applies({hostenv.OPT_OUT: "0"})


@pytest.mark.skipif(not (hostenv.malloc_tuning_applies({}) and _thp_available()),
                    reason="needs Linux, glibc >= 2.35 and transparent huge pages")
def test_reexec_sets_the_tunable_and_the_temporaries_stop_faulting():
  tuned, tuned_faults = _run()
  assert tuned == hostenv.TUNABLES
  off, off_faults = _run(**{hostenv.OPT_OUT: "0"})
  assert off == "None"
  # 68 MiB in 4 KiB pages is ~17,000 faults per run; in 2 MiB pages, a few dozen.
  assert tuned_faults < off_faults / 4, (tuned_faults, off_faults)

"""launch.py and benchmarks/run.py re-execute under glibc's huge-page malloc
(train/hostenv.py): XLA:CPU's per-step temporaries then stop page-faulting."""

import importlib.util
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


def test_default_platforms_cpu_only_without_an_accelerator_and_outside_compile():
  argv = ["launch.py", "--mode", "eval"]
  assert hostenv.default_platforms(argv, {}, nodes=[]) == "cpu"
  assert hostenv.default_platforms(["launch.py"], {}, nodes=[]) == "cpu"  # train
  assert hostenv.default_platforms(argv, {}, nodes=["/dev/accel0"]) is None
  assert hostenv.default_platforms(argv, {"JAX_PLATFORMS": "tpu"}, nodes=[]) is None
  for compile_argv in (["launch.py", "--mode", "compile"], ["launch.py", "--mode=compile"]):
    assert hostenv.default_platforms(compile_argv, {}, nodes=[]) is None


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="the noise comes from libtpu's start-up")
def test_launch_preamble_silences_libtpu_on_a_host_without_tpu():
  """What launch.py's __main__ runs before JAX starts, then a backend start: with libtpu
  installed and no TPU attached, none of its 'host bounds' / INVALID_ARGUMENT noise."""
  if hostenv.default_platforms(["launch.py"], {}) is None:
    pytest.skip("this host has an accelerator device node")
  code = ("import sys; sys.argv = ['launch.py', '--mode', 'eval']\n"
          "from train.hostenv import quiet_backend_default; quiet_backend_default()\n"
          "import jax; print(jax.default_backend())")
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                       text=True, timeout=60, check=True,
                       cwd=ROOT)
  assert res.stdout.strip() == "cpu"
  for noise in ("Failed to find host bounds", "INVALID_ARGUMENT", "Source Location Trace"):
    assert noise not in res.stderr


@pytest.mark.parametrize("package", ["train", "experiments.report", "benchmarks"])
def test_plain_scripts_default_to_cpu_and_keep_the_users_platforms(package):
  """Issue 46 item 7: `python -m benchmarks.x`, `python -m experiments.report`, a notebook's
  `from train import load_run` start JAX on the CPU where no accelerator is attached (no
  TPU probe once libtpu is installed); a JAX_PLATFORMS the user set is never overridden."""
  if hostenv.default_platforms(["script.py"], {}) is None:
    pytest.skip("this host has an accelerator device node")
  code = f"import sys; sys.argv = ['script.py']\nimport {package}, jax; print(jax.config.jax_platforms)"
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  cases = ((None, "cpu"),) + ((("cpu,tpu", "cpu,tpu"),) if package == "train" else ())
  for platforms, want in cases:  # The user's setting: once is enough (one code path).
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**env, **({"JAX_PLATFORMS": platforms} if platforms else {})},
                         timeout=60, check=True, cwd=ROOT)
    assert res.stdout.strip() == want, (platforms, res.stdout, res.stderr[-500:])

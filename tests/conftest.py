"""Test setup: 8 simulated CPU devices and strict JAX flags, before jax is imported.

A persistent compilation cache (shared with the subprocesses tests launch)
means each distinct program compiles once per machine, not once per test.
"""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Test programs are tiny: LLVM's optimisation of the CPU code costs far more
# (about half of the suite's time) than it saves, so tests compile at -O0.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(ROOT, ".pytest_cache", "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_threefry_partitionable", True)
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(scope="module")
def no_persistent_cache():
  """Programs of the module compile afresh, in-process and in the subprocesses it starts.

  jaxlib 0.10.2 on CPU: an 8-device train step loaded from the persistent compilation
  cache can deadlock its device threads in a collective (XLA aborts the process after a
  40 s rendezvous timeout: "Fatal Python error: Aborted"); compiled afresh it runs. Seen
  with expert-parallel all_to_all (tests/parallel/test_expert_cli.py) and, once under
  2 xdist workers, with the data-parallel MoE run of tests/train/test_moe_training.py.
  Use with `pytestmark = pytest.mark.usefixtures("no_persistent_cache")`.
  """
  from jax._src import compilation_cache  # pylint: disable=g-import-not-at-top
  before = jax.config.jax_enable_compilation_cache
  # jax decides once per process whether the cache is used: reset_cache makes it look again.
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()
  old_env = os.environ.get("JAX_ENABLE_COMPILATION_CACHE")
  os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
  yield
  jax.config.update("jax_enable_compilation_cache", before)
  compilation_cache.reset_cache()
  if old_env is None:
    del os.environ["JAX_ENABLE_COMPILATION_CACHE"]
  else:
    os.environ["JAX_ENABLE_COMPILATION_CACHE"] = old_env

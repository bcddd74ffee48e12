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

jax.config.update("jax_threefry_partitionable", True)
jax.config.update("jax_numpy_rank_promotion", "raise")

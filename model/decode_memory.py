"""Free memory on a device, for checks made before compiling (e.g. that a KV cache
for `max_new_tokens` fits: model/kv_cache.py's check_cache_memory)."""

from __future__ import annotations

import os
from typing import Any

import jax


def available_bytes(device: Any = None) -> tuple[int, str] | None:
  """(bytes free for new buffers on `device`, what that is), or None if unknown.

  Accelerators report their allocator's limit and use; CPU buffers live in
  host memory, whose MemAvailable counts reclaimable page cache as free.
  """
  device = device or jax.local_devices()[0]
  try:
    stats = device.memory_stats() or {}
  except Exception:  # pylint: disable=broad-except  # Not every backend implements it.
    stats = {}
  if "bytes_limit" in stats:
    return (int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)),
            f"{device.platform.upper()} memory ({device.device_kind})")
  try:
    with open("/proc/meminfo") as f:
      kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    return kib * 1024, "available host memory"
  except (OSError, StopIteration, ValueError):
    pass
  try:
    return (os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free host memory")
  except (AttributeError, OSError, ValueError):
    return None

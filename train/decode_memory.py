"""Free memory on a device, and the check made before compiling that a KV cache for
`max_new_tokens` fits in it (host code: the cache's shapes come from model/decode/cache.py)."""

from __future__ import annotations

import os
from typing import Any

import jax

from model.config import ModelConfig
from model.decode.cache import cache_bytes


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


def check_cache_memory(cfg: ModelConfig, batch: int, prompt_len: int,
                       max_new_tokens: int) -> None:
  """Refuse, before compiling, a KV cache larger than the device's free memory.

  From the longest local window W on (W = 0 without local layers), the cache is
  linear in its length (global layers grow, ring buffers are full), so two tiny
  shape evaluations give its size at any length, even one far too large to trace;
  below W it is evaluated directly. Passing is necessary, not sufficient: weights
  and activations need memory too.
  """
  length = prompt_len + max_new_tokens - 1
  w = max(cfg.layer_kind(i).window for i in range(cfg.num_layers))
  per_slot = cache_bytes(cfg, batch, w + 2) - cache_bytes(cfg, batch, w + 1)
  fixed = cache_bytes(cfg, batch, w + 1) - per_slot * (w + 1)
  need = fixed + per_slot * length if length > w else cache_bytes(cfg, batch, length)
  free = available_bytes()
  if free is None or need <= free[0]:
    return
  # Below the window this underestimates the largest fit: the ring buffers are not full.
  largest = ((free[0] - fixed) // per_slot - prompt_len + 1) if per_slot else 0
  fits = (f"the largest max_new_tokens whose cache fits is {largest:,}" if largest >= 1
          else "not even the prompt's cache fits: shorten the prompt or batch")
  raise ValueError(
      f"--max_new_tokens={max_new_tokens:,}: the KV cache for {batch} prompt(s) of up to "
      f"{prompt_len} tokens needs {need / 2**30:,.2f} GiB but only {free[0] / 2**30:,.2f} GiB "
      f"of {free[1]} is free; {fits} (less, to leave room for the weights)")

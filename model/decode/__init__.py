"""Decoding: the jitted prefill / decode loop, the KV cache's layout, sampling.

  loop.py      prefill and decode (one lax.while_loop over the cache)
  cache.py     the config decoding runs with, cache shapes, sizes and initialisation
  sampling.py  greedy, temperature, top-k and top-p sampling

Host-side generation (padding, timing, the free-memory check) is train/generate.py
and train/decode_memory.py.
"""

from model.decode.loop import PAD, DecodeState, check_length, decode, left_align, prefill
from model.decode.sampling import Sampling, sample

__all__ = ["PAD", "DecodeState", "Sampling", "check_length", "decode", "left_align",
           "prefill", "sample"]

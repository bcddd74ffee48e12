"""Packing a token stream into fixed-length windows with segment ids and positions.

Window w of length L holds stream tokens [w*L, w*L + L + 1): L inputs and
their L next-token targets, so consecutive windows share one token and every
stream token is a target exactly once. Documents run across windows; each
window renumbers its documents 1, 2, 3.. and restarts positions at 0 where a
document (or the window) begins, since attention never reaches further back.
"""

from __future__ import annotations

import numpy as np

from train.data.streams import TokenStream


def num_windows(stream_len: int, seq_len: int) -> int:
  """Windows needed so every token after the first is a target once."""
  return max(0, -(-(stream_len - 1) // seq_len))


def pack_window(stream: TokenStream, index: int, seq_len: int, vocab_size: int) -> dict:
  """Window `index` as {"inputs", "targets", "positions", "segment_ids": int32 [L],
  "weights": float32 [L]}. Weight 0 where the target is padding or belongs to
  another document than its input; segment id 0 marks padding."""
  L = seq_len
  start = index * L
  stop = min(start + L + 1, len(stream))
  if not 0 <= start < stop - 1:
    raise IndexError(f"window {index} outside stream of {len(stream)} tokens (seq_len {L})")
  toks, new_doc = stream.read(start, stop)
  n = len(toks)
  if toks.max() >= vocab_size:
    raise ValueError(f"token id {int(toks.max())} in window {index} is outside the "
                     f"tokenizer's vocabulary ({vocab_size}): wrong data.token_dtype, "
                     "data.tokenizer or data.vocab_size?")
  tok = np.zeros([L + 1], np.int32)
  tok[:n] = toks
  valid = np.arange(L + 1) < n
  new = np.zeros([L + 1], bool)
  new[:n] = new_doc
  new[0] = True  # A window always opens a segment, continuing document or not.
  seg = np.where(valid, np.cumsum(new), 0).astype(np.int32)
  idx = np.arange(L + 1)
  pos = np.where(valid, idx - np.maximum.accumulate(np.where(new, idx, 0)), 0)
  weights = (seg[1:] == seg[:L]) & valid[1:]
  return {
      "inputs": tok[:L],
      "targets": tok[1:],
      "positions": pos[:L].astype(np.int32),
      "segment_ids": seg[:L],
      "weights": weights.astype(np.float32),
  }

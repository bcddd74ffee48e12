"""Reading a JSON file that a user or another tool wrote: one error naming the file."""

from __future__ import annotations

import json

from train.io import storage


def read_json_object(path: str) -> dict:
  """The JSON object in `path`, or one ValueError naming the file and the problem (not
  JSON, not UTF-8, nested too deep for the parser, not an object)."""
  try:
    out = json.loads(storage.read_text(path))
  except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError.
    raise ValueError(f"{path} is not valid JSON ({type(e).__name__}: "
                     f"{str(e)[:200] or 'nested too deep'})") from None
  if not isinstance(out, dict):
    raise ValueError(f"{path} holds a JSON {type(out).__name__}, not an object")
  return out

"""Parsing the named-corpus fields: `data.datasets`, `data.mixture`, `eval.corpora`.

    data.datasets = "web=prepared/web,code=gs://bucket/code"   # name=path, comma-separated
    data.mixture  = "web:0.7,code:0.3"                          # name:weight (any positive scale)
    eval.corpora  = "docs=prepared/docs,stdlib=src/**/*.txt"    # name=path, evaluated apart

Imported by train/spec/checks.py, so it stays free of heavy imports.
"""

from __future__ import annotations

import math
import re

_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")  # A metric suffix: bpb/<name>.


def _items(text: str, field: str, sep: str) -> list[tuple[str, str]]:
  if not isinstance(text, str):
    raise ValueError(f"config.{field}={text!r}: must be a string like "
                     f"'a{sep}...,b{sep}...'")
  out, seen = [], set()
  for item in filter(None, (i.strip() for i in text.split(","))):
    name, has, value = (s.strip() for s in item.partition(sep))
    if not has or not value or not _NAME.match(name):
      raise ValueError(f"config.{field}={text!r}: {item!r} is not name{sep}value (names: "
                       "letters, digits, _ . -)")
    if name in seen:
      raise ValueError(f"config.{field}={text!r}: {name!r} is named twice")
    seen.add(name)
    out.append((name, value))
  return out


def named_paths(text: str, field: str) -> dict[str, str]:
  """"a=path,b=path" -> {"a": "path", ...} (insertion order kept)."""
  return dict(_items(text, field, "="))


def mixture_weights(text: str, datasets: dict[str, str],
                    field: str = "data.mixture") -> dict[str, float]:
  """"web:0.7,code:0.3" -> normalised weights; every name must be in `datasets`."""
  out = {}
  for name, value in _items(text, field, ":"):
    if name not in datasets:
      raise ValueError(f"config.{field}={text!r}: {name!r} is not a dataset named in "
                       f"data.datasets ({', '.join(datasets) or 'none'})")
    try:
      w = float(value)
    except ValueError:
      w = math.nan
    if not (math.isfinite(w) and w > 0):
      raise ValueError(f"config.{field}={text!r}: the weight of {name!r} is {value!r}; "
                       "weights must be positive numbers")
    out[name] = w
  if not out:
    raise ValueError(f"config.{field}={text!r}: name at least one dataset with a weight, "
                     "e.g. 'web:0.7,code:0.3'")
  total = sum(out.values())
  return {k: v / total for k, v in out.items()}

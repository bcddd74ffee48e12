"""Collective traffic of a compiled (SPMD-partitioned, per-device) HLO module.

Each all-gather, reduce-scatter, all-reduce, all-to-all and collective-permute is
counted as often as it runs: an op inside a `while` body (the scanned layers, gradient
accumulation) runs once per trip, read off the loop condition's bound. Bytes are the
per-device result sizes; `wire_bytes` is what a ring algorithm sends per device:
all-gather and all-to-all (n-1)/n of the result, reduce-scatter (n-1) x the result,
all-reduce 2(n-1)/n, a permute all of it. A ragged all-to-all (dropless expert
parallelism) sends as many rows as the routing says: its output buffer, the most it can
receive, is counted (an upper bound).

Across slices (multi-slice, `--num_slices`), XLA:TPU compiles each slice's part of a
collective as the ops above over that slice's chips (replica groups of slice-local ids:
on the chip interconnect, ICI) and the part that crosses the data-centre network (DCN) as
a `send` / `recv` pair handed to the Megascale runtime, labelled with its transfer type
(`ONE_TO_ONE` for a permute, `ALL_REDUCE`, `ALL_GATHER`, ...). `dcn_collectives` counts
those sends: what crosses between slices, per collective kind.
"""

from __future__ import annotations

import collections
import re

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "ragged-all-to-all", "all-to-all",
         "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "bf16": 2, "f16": 2,
                "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8,
                "u64": 8, "c64": 8, "c128": 16}
_COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_OP = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = (.*?) (" + "|".join(KINDS) + r")(-start)?\(")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|true_computation|false_computation)"
                    r"=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_SEND = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = (.*?) send\(.*"
                   r"_xla_megascale_transfer_type=\"?([A-Z_]+)")
# Megascale's transfer types as the collective kinds above.
_DCN_KINDS = {"ONE_TO_ONE": "collective-permute", "ALL_REDUCE": "all-reduce",
              "ALL_GATHER": "all-gather", "REDUCE_SCATTER": "reduce-scatter",
              "ALL_TO_ALL": "all-to-all"}
_WHILE = re.compile(r"\swhile\(.*condition=%?([\w.\-]+), body=%?([\w.\-]+)")


def _bytes(type_text: str) -> float:
  total = 0.0
  for dtype, dims in _ARRAY.findall(type_text):
    if dtype in _DTYPE_BYTES:
      n = 1
      for d in filter(None, dims.split(",")):
        n *= int(d)
      total += n * _DTYPE_BYTES[dtype]
  return total


def _largest(type_text: str) -> float:
  return max((_bytes(f"{d}[{s}]") for d, s in _ARRAY.findall(type_text)), default=0.0)


def _group_size(line: str) -> int:
  """Devices per replica group, from any of HLO's three spellings."""
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
  if m:
    sizes = dict((k.strip("' "), int(v)) for k, v in
                 (item.split("=") for item in m.group(1).split(",")))
    return max(1, _prod(sizes[a.strip("' ")] for a in m.group(2).split(",") if a.strip()))
  m = re.search(r"replica_groups=\[([0-9,]+)\]<=", line)
  if m:
    return int(m.group(1).split(",")[-1])
  m = re.search(r"replica_groups=\{\{([0-9,]*)\}", line)
  if m:
    return max(1, len(m.group(1).split(",")))
  m = re.search(r"source_target_pairs=\{([^}]*)\}", line)
  return 2 if m else 1


def _prod(xs) -> int:
  out = 1
  for x in xs:
    out *= x
  return out


def _computations(text: str) -> tuple[dict[str, list[str]], str]:
  comps, name, entry = {}, None, None
  for line in text.splitlines():
    m = None if line[:1].isspace() else _COMP.match(line)
    if m:
      name = m.group(1)
      comps[name] = []
      if line.startswith("ENTRY"):
        entry = name
    elif name is not None:
      comps[name].append(line)
  return comps, entry


def _trip_count(cond: list[str]) -> int:
  """The bound a scan's loop condition compares its counter with (1 if unreadable)."""
  bounds = [int(v) for line in cond for v in re.findall(r"constant\((-?\d+)\)", line)
            if "s32[]" in line or "s64[]" in line or "u32[]" in line]
  bounds = [b for b in bounds if b > 0]
  return max(bounds) if bounds else 1


def _multiplicities(comps: dict[str, list[str]], entry: str) -> dict[str, int]:
  mult = collections.defaultdict(int)
  mult[entry] = 1
  order = [entry]
  seen = {entry}
  while order:
    name = order.pop()
    for line in comps.get(name, ()):
      w = _WHILE.search(line)
      trips = _trip_count(comps.get(w.group(1), [])) if w else 1
      callees = _CALLS.findall(line)
      for b in _BRANCHES.findall(line):
        callees += [c.strip().lstrip("%") for c in b.split(",")]
      for callee in callees:
        times = trips if w and callee == w.group(2) else 1
        mult[callee] = max(mult[callee], mult[name] * times)
        if callee not in seen:
          seen.add(callee)
          order.append(callee)
  return mult


def collective_bytes(hlo_text: str) -> dict[str, dict[str, float]]:
  """{kind: {"count", "bytes", "wire_bytes"}} per device per step, and "total"."""
  comps, entry = _computations(hlo_text)
  mult = _multiplicities(comps, entry) if entry else {}
  out = {k: {"count": 0, "bytes": 0.0, "wire_bytes": 0.0} for k in KINDS}
  for name, lines in comps.items():
    times = mult.get(name, 0)
    for line in lines:
      m = _OP.match(line)
      if not m or not times:
        continue
      kind, n = m.group(2), _group_size(line)
      # An async start's result is (operand(s), result): count the result alone.
      size = (_largest(m.group(1)) if m.group(3) and kind != "all-reduce"
              else _bytes(m.group(1)))
      wire = {"all-gather": size * (n - 1) / n, "all-to-all": size * (n - 1) / n,
              "ragged-all-to-all": size * (n - 1) / n,
              "reduce-scatter": size * (n - 1), "all-reduce": 2 * size * (n - 1) / n,
              "collective-permute": size}[kind]
      if n == 1 and kind != "collective-permute":
        wire = 0.0
      rec = out[kind]
      rec["count"] += times
      rec["bytes"] += size * times
      rec["wire_bytes"] += wire * times
  out["total"] = {f: sum(out[k][f] for k in KINDS) for f in ("count", "bytes", "wire_bytes")}
  return out


def dcn_collectives(hlo_text: str) -> dict[str, dict[str, float]]:
  """What crosses the data-centre network between slices, per device per step:
  {kind: {"count", "bytes"}} for the kinds that cross (the sends XLA:TPU hands to the
  Megascale runtime, counted as often as they run; bytes: each send's buffer), and
  "total". Empty but for a zero total in a single-slice program."""
  comps, entry = _computations(hlo_text)
  mult = _multiplicities(comps, entry) if entry else {}
  out: dict[str, dict[str, float]] = {}
  for name, lines in comps.items():
    times = mult.get(name, 0)
    for line in lines:
      m = _SEND.match(line)
      if not m or not times:
        continue
      kind = _DCN_KINDS.get(m.group(2), m.group(2).lower().replace("_", "-"))
      rec = out.setdefault(kind, {"count": 0, "bytes": 0.0})
      rec["count"] += times
      rec["bytes"] += _largest(m.group(1)) * times
  out["total"] = {f: sum(r[f] for r in out.values()) for f in ("count", "bytes")}
  return out


# Matmuls: XLA:TPU writes most dots as `convolution`s (and fuses the int32 -> float
# rescale into them, so a result type says nothing): the operands' types say what the MXU
# multiplies. Keyed by those: "s8" (int8 x int8, model.quantization="int8"), "f8e4m3fn",
# "bf16", "f32"; two different types as "bf16*s8".
_MATMUL = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+?\[[0-9,]*\])\S* (dot|convolution)"
                     r"\(%?([\w.\-]+), %?([\w.\-]+)\)(.*)$")
_DEF = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ([a-z][a-z0-9]*)\[([0-9,]*)\]")


def _dims(text: str) -> list[int]:
  return [int(d) for d in text.split(",") if d]


def _matmul_flops(out_dims, lhs_dims, rhs_dims, kind: str, attrs: str) -> float:
  """2 x output elements x the multiply-adds of each: a dot's contracted lhs dims; a
  convolution's input features x window (its kernel over its output features; padded
  window positions included: nominal)."""
  out = _prod(out_dims)
  if kind == "dot":
    m = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", attrs)
    return 2.0 * out * _prod(lhs_dims[i] for i in _dims(m.group(1) if m else ""))
  m = re.search(r"dim_labels=[^_]*_([^-]*)->", attrs)
  o = m.group(1).index("o") if m and "o" in m.group(1) else len(rhs_dims) - 1
  return 2.0 * out * _prod(rhs_dims) / max(1, rhs_dims[o])


_PLUMBING = {"while", "body", "closed_call", "checkpoint", "rematted_computation", "cond",
             "dot_general", "convolution", "remat"}


def _module(line: str) -> str:
  """The Flax module path in an op's metadata ("layers/attn/q"), without the jit /
  transformation wrappers, loop plumbing and the einsum's own name."""
  m = re.search(r'op_name="([^"]*)"', line)
  parts = [p for p in (m.group(1).split("/") if m else ())
           if "(" not in p and "->" not in p and p not in _PLUMBING]
  return "/".join(parts) or "?"


def matmul_ops(hlo_text: str) -> dict[str, dict]:
  """{operand types: {"count", "flops", "modules": {module path: count}}} of the module's
  dots and convolutions per device per step (each counted as often as it runs, as
  collectives are; a module's forward, rematerialised and backward dots together), and
  "total"."""
  comps, entry = _computations(hlo_text)
  mult = _multiplicities(comps, entry) if entry else {}
  out: dict[str, dict[str, float]] = {}
  for name, lines in comps.items():
    times = mult.get(name, 0)
    if not times:
      continue
    types = {m.group(1): (m.group(2), _dims(m.group(3)))
             for m in map(_DEF.match, lines) if m}
    for line in lines:
      m = _MATMUL.match(line)
      if not m or m.group(4) not in types or m.group(5) not in types:
        continue
      (lt, ld), (rt, rd) = types[m.group(4)], types[m.group(5)]
      key = lt if lt == rt else "*".join(sorted((lt, rt)))
      out_dims = _dims(m.group(2).split("[")[1].rstrip("]"))
      rec = out.setdefault(key, {"count": 0, "flops": 0.0, "modules": {}})
      rec["count"] += times
      where = _module(line)
      rec["modules"][where] = rec["modules"].get(where, 0) + times
      rec["flops"] += _matmul_flops(out_dims, ld, rd, m.group(3), m.group(6)) * times
  out["total"] = {f: sum(r[f] for r in out.values()) for f in ("count", "flops")}
  return out


# Host memory is memory space 5 in XLA:TPU's layouts (`{...S(5)}`: pinned_host). An
# offloading remat policy's residuals go there as async copies (`copy-start`, its result
# (destination, source, context)) or, from a scanned layer stack, as slices written into
# and read out of a host buffer (`dynamic-update-slice-start` / `dynamic-slice-start`).
_HOST_OP = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = (.*?) "
                      r"(copy-start|dynamic-update-slice-start|dynamic-slice-start)\(")
_LAID_OUT = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")


def _device_side(type_text: str) -> float:
  """The largest array of an async op's result that is not in host memory: the bytes
  one transfer moves."""
  return max((_bytes(f"{d}[{s}]") for d, s, layout in _LAID_OUT.findall(type_text)
              if "S(5)" not in layout), default=0.0)


def host_transfers(hlo_text: str) -> dict[str, float]:
  """Bytes per device per step between the chip and its host memory, each transfer
  counted as often as it runs (a scanned layer's, once per layer): {"to_host",
  "from_host", "count"}. Zero without an offloading policy. A check beside
  `memory_analysis`'s host buffers, not the roofline's figure (train/aot/estimate.py):
  where XLA peels a loop's first trip out of it, that trip counts twice (measured: 5 of
  4 scanned layers' stores on tiny.py at qkv_proj_offloaded, v5e:2x2)."""
  comps, entry = _computations(hlo_text)
  mult = _multiplicities(comps, entry) if entry else {}
  out = {"to_host": 0.0, "from_host": 0.0, "count": 0}
  for name, lines in comps.items():
    times = mult.get(name, 0)
    for line in lines:
      m = _HOST_OP.match(line)
      if not m or not times or "S(5)" not in m.group(1):
        continue
      kind, result = m.group(2), m.group(1)
      if kind == "copy-start":  # (destination, source, context): to host if the first is.
        first = re.match(r"\(?\s*[a-z0-9]+\[[0-9,]*\](\{[^}]*\})?", result)
        to_host = bool(first and first.group(1) and "S(5)" in first.group(1))
      else:
        to_host = kind == "dynamic-update-slice-start"
      out["to_host" if to_host else "from_host"] += _device_side(result) * times
      out["count"] += times
  return out

"""The targets of issue 8, each a ratio (or fraction) read from one run's results.

`build(results)` returns one dict per target: name, value, threshold, op (">=" or
"<="), met, and what the value is. A target whose inputs are missing (a section
failed or was skipped) gets value None and met False: unmeasured is not met.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

from benchmarks import compile_time, decode_compare, moe_dispatch

OPS = {">=": operator.ge, "<=": operator.le}
CURVE_GAP = 0.02  # bf16 vs f32 block-mean losses may differ by at most 2%.


def _spec() -> list[tuple[str, str, float, str, Callable[[dict], float]]]:
  """(name, op, threshold, description, value from results)."""
  own = lambda r, c, dt="float32": r["train"]["project"][c][dt]["tokens_per_s"]
  ref = lambda r, c: r["train"]["reference"][c]["tokens_per_s"]
  dec = lambda r, b, p: decode_compare.point(r["decode"], "GQA", b, p)
  pos = lambda r: r["decode"]["positions"]
  layers = lambda r: r["compile"]["layers"]
  specs = [
      ("train_f32_tokens_per_s_vs_reference_S", ">=", 1.0,
       "float32 training tokens/s at S over HF Llama's", lambda r: own(r, "S") / ref(r, "S")),
      ("train_f32_tokens_per_s_vs_reference_M", ">=", 1.0,
       "float32 training tokens/s at M over HF Llama's", lambda r: own(r, "M") / ref(r, "M")),
      ("train_f32_mfu_M", ">=", 0.6,
       "float32 training MFU at M (fraction of the measured float32 matmul peak)",
       lambda r: r["train"]["project"]["M"]["float32"]["mfu"]),
      ("train_bf16_vs_f32_tokens_per_s_M", ">=", 2.0,
       "bfloat16-compute training tokens/s at M over float32's",
       lambda r: own(r, "M", "bfloat16") / own(r, "M")),
      ("train_bf16_loss_curve_gap", "<=", CURVE_GAP,
       "largest relative gap between bf16 and f32 loss curves (block means) at S",
       lambda r: r["train"]["loss_curves"]["max_block_gap"]),
      ("train_moe_s_tokens_per_s_vs_reference_mixtral", ">=", 1.0,
       "MoE-S float32 training tokens/s over HF Mixtral's",
       lambda r: own(r, "MoE-S") / ref(r, "MoE-S")),
  ]
  for path in moe_dispatch.LOCAL + ("expert_parallel",):
    specs.append((f"moe_s_step_vs_dense_{path}", "<=", 1.3,
                  f"MoE-S step time over the dense S step (equal active parameters), {path}",
                  lambda r, p=path: moe_dispatch.ratio(r["moe"], p)))
  specs += [
      ("compile_scanned_32_vs_4_layers", "<=", 1.5,
       "train-step compile time, scanned: most layers over fewest",
       lambda r: compile_time.total(r["compile"], layers(r)[-1], True) /
       compile_time.total(r["compile"], layers(r)[0], True)),
  ]
  for b in (1, 8):
    specs.append((f"decode_latency_240_vs_16_M_B{b}", "<=", 1.1,
                  f"M (GQA) per-token decode latency at the last position over the first, B={b}",
                  lambda r, b=b: dec(r, b, pos(r)[-1])["step_ms"] / dec(r, b, pos(r)[0])["step_ms"]))
  specs.append(("decode_tokens_per_s_vs_reference_M_B1", ">=", 1.0,
                "M (GQA) batch-1 decode tokens/s over HF generate's",
                lambda r: dec(r, 1, pos(r)[-1])["decode_tokens_per_s"] /
                r["decode"]["reference"]["decode_tokens_per_s"]))
  return specs


NAMES = tuple(s[0] for s in _spec())


def build(results: dict[str, Any]) -> list[dict[str, Any]]:
  out = []
  for name, op, threshold, what, value_fn in _spec():
    try:
      value = float(value_fn(results))
    except (KeyError, TypeError, ZeroDivisionError, IndexError) as e:
      out.append({"name": name, "value": None, "threshold": threshold, "op": op,
                  "met": False, "what": what, "missing": f"{type(e).__name__}: {e}"})
      continue
    out.append({"name": name, "value": value, "threshold": threshold, "op": op,
                "met": bool(OPS[op](value, threshold)), "what": what})
  return out

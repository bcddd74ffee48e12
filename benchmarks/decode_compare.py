"""Decode at M: this project's MHA / GQA / MQA (benchmarks/decode.py) and HF `generate`.

Positions: the project's per-token latency "at position p" is the mean step of a
generation of p new tokens (the cache holds prompt + p slots and every step reads
all of them, so every step of that generation costs what its last one does); the
reference's is read inside one 240-token `generate` (reference_hf.generate_speed).
M is the GQA layout (2 KV heads), so the reference runs that one, at batch 1.
"""

from __future__ import annotations

from benchmarks import common
from benchmarks import decode as decode_lib
from benchmarks import reference_hf
from benchmarks.common import Mode
from model import ModelConfig

POSITIONS = (16, 240)
SMOKE_POSITIONS = (4, 12)
SMOKE_SIZE = dict(vocab_size=256, d_model=64, num_layers=2, mlp_dim=128, max_seq_len=64)


def _smoke_project(positions: tuple[int, ...]) -> dict:
  """decode_lib.run's schema on a tiny config: GQA only, a few tokens."""
  cfg = ModelConfig(num_kv_heads=decode_lib.LAYOUTS["GQA"],
                    **{**decode_lib.CONFIG_M, **SMOKE_SIZE})
  variables = decode_lib.random_variables(cfg)
  results = []
  for batch in (1, 8):
    for new in positions:
      point = decode_lib.measure(cfg, variables, batch, new, reps=1)
      results.append({"layout": "GQA", "num_kv_heads": cfg.num_kv_heads, **point})
  return {"benchmark": "decode", "config": cfg.to_dict(), "prompt_len": decode_lib.PROMPT_LEN,
          "quick": True, "results": results}


def run(mode: Mode) -> dict:
  """{"positions", "project": decode_lib.run's dict, "reference": generate_speed's}."""
  positions = SMOKE_POSITIONS if mode.smoke else POSITIONS
  if mode.smoke:
    project = _smoke_project(positions)
    ref_cfg = ModelConfig(num_kv_heads=decode_lib.LAYOUTS["GQA"],
                          **{**decode_lib.CONFIG_M, **SMOKE_SIZE})
  else:
    project = decode_lib.run(quick=mode.name != "full")
    ref_cfg = common.model_config("M", mode)
  reference = reference_hf.generate_speed(ref_cfg, mode, positions, decode_lib.PROMPT_LEN)
  return {"positions": list(positions), "project": project, "reference": reference}


def point(decode: dict, layout: str, batch: int, new_tokens: int) -> dict:
  """The project's result for one (layout, batch, generated tokens)."""
  for r in decode["project"]["results"]:
    if (r["layout"], r["batch"], r["new_tokens"]) == (layout, batch, new_tokens):
      return r
  raise KeyError(f"no decode result for {layout} B={batch} new={new_tokens}")

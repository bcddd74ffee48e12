"""Model size presets and the smoke shrink: one table, shared by the experiment
configs (experiments/configs/base.py, `size=...`) and the benchmarks
(benchmarks/common.py, S / M / MoE-S)."""

from __future__ import annotations

from typing import Any, Mapping

# The experiments' `size=` presets (base.py adds max_seq_len=256; the vocabulary is the tokenizer's).
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(d_model=128, num_layers=4, num_heads=4, num_kv_heads=4, mlp_dim=512),
    "small": dict(d_model=256, num_layers=6, num_heads=8, num_kv_heads=8, mlp_dim=1024),
    "medium": dict(d_model=512, num_layers=8, num_heads=8, num_kv_heads=8, mlp_dim=1408),
}
# The benchmarks' configs (issue 8), complete but for MoE fields (benchmarks/common.py).
BENCHMARK_SIZES: dict[str, dict[str, int]] = {
    "S": dict(vocab_size=256, d_model=256, num_layers=4, num_heads=4, num_kv_heads=4,
              mlp_dim=1024, max_seq_len=256),
    "M": dict(vocab_size=4096, d_model=512, num_layers=8, num_heads=8, num_kv_heads=2,
              mlp_dim=1408, max_seq_len=512),
}


def smoke_fields(model: Mapping[str, Any], *, max_seq_len: int,
                 max_experts: int | None = None) -> dict[str, Any]:
  """The ModelConfig fields that shrink `model` (its field values) to seconds of work
  with the same structure (GQA grouping up to 4 heads, head_dim if set, MoE top-k);
  `max_experts` caps the expert count (None: keep it, e.g. for an expert mesh axis)."""
  out = dict(d_model=32, num_layers=2, num_heads=4, mlp_dim=64, max_seq_len=max_seq_len,
             num_kv_heads=min(model["num_kv_heads"], 4))
  if model.get("head_dim") is not None:
    out["head_dim"] = 8
  if model.get("num_experts"):
    experts = model["num_experts"]
    out.update(num_experts=experts if max_experts is None else min(experts, max_experts),
               experts_per_token=min(model["experts_per_token"], 2), expert_mlp_dim=32)
  return out

"""One MoE layer: canonical HF tensors <-> model/moe/layer.py's MoE variables.

Canonical names (Mixtral's w1/w3/w2 renamed by hf_weights.to_canonical; Glm4Moe
and DeepSeek-V3 already use them): `mlp.gate.weight` [E,D] (router),
`mlp.gate.e_score_correction_bias` [E] (DeepSeek-V3 loss-free bias, a buffer),
`mlp.experts.{e}.{gate,up,down}_proj.weight`, `mlp.shared_experts.*` (one FFN
of width n_shared * F, as blockwork's shared expert).

blockwork: ffn/router/gate/w [D,E]; ffn/wg, ffn/wi [E,D,F]; ffn/wo [E,F,D];
ffn/shared/{wg,wi,wo}/w; the bias in collection "moe_state" at ffn/router/bias.
"""

from __future__ import annotations

import numpy as np

from model.config import ModelConfig
from model.moe.router import BIAS


def moe_to_variables(get, cfg: ModelConfig) -> tuple[dict, dict]:
  """(ffn params, {"moe_state": ...} or {}) of one MoE layer."""
  E = cfg.num_experts
  expert = lambda p: np.stack([get(f"mlp.experts.{e}.{p}_proj.weight").T for e in range(E)])
  ffn = {"router": {"gate": {"w": get("mlp.gate.weight").T}},
         "wg": expert("gate"), "wi": expert("up"), "wo": expert("down")}
  if cfg.num_shared_experts:
    ffn["shared"] = {"wg": {"w": get("mlp.shared_experts.gate_proj.weight").T},
                     "wi": {"w": get("mlp.shared_experts.up_proj.weight").T},
                     "wo": {"w": get("mlp.shared_experts.down_proj.weight").T}}
  state = {}
  if cfg.load_balance == "loss_free":
    bias = np.asarray(get("mlp.gate.e_score_correction_bias"), np.float32)
    state = {"moe_state": {"ffn": {"router": {BIAS: bias}}}}
  return ffn, state


def moe_to_hf(ffn: dict, state: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
  out = {"mlp.gate.weight": ffn["router"]["gate"]["w"].T}
  for e in range(cfg.num_experts):
    for ours, theirs in (("wg", "gate"), ("wi", "up"), ("wo", "down")):
      out[f"mlp.experts.{e}.{theirs}_proj.weight"] = ffn[ours][e].T
  if cfg.num_shared_experts:
    for ours, theirs in (("wg", "gate"), ("wi", "up"), ("wo", "down")):
      out[f"mlp.shared_experts.{theirs}_proj.weight"] = ffn["shared"][ours]["w"].T
  if cfg.router_score == "sigmoid":  # The DeepSeek-V3 router always has the bias.
    bias = state.get("moe_state", {}).get("ffn", {}).get("router", {}).get(BIAS)
    out["mlp.gate.e_score_correction_bias"] = (
        np.asarray(bias, np.float32) if bias is not None else np.zeros([cfg.num_experts],
                                                                       np.float32))
  return out

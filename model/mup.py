"""µP, the maximal-update parametrisation (Yang et al. 2022, "Tensor Programs V"),
relative to a base width: `ModelConfig.mup_base_width` (0: the standard
parametrisation, SP). With width multiplier m = d_model / mup_base_width:

- initialisation: hidden matrices (attention q/k/v/o, FFN) draw from
  normal(init_std / sqrt(m)), variance ∝ 1 / fan-in; the embedding keeps its std;
- attention logits q.k * sqrt(H_base) / H (1/d instead of 1/sqrt(d); H_base the head
  dim at the base width), so they stay O(1) when q and k align as training makes them;
- output logits times 1 / m (the readout multiplier);
- Adam learning rates: hidden matrices train at lr / m, everything else at lr
  (train/optim.py `mup_labels`, an optax.multi_transform).

At m = 1 every factor is 1: µP equals SP at the base width, so a learning rate tuned
there is the one to transfer. Tied embeddings (one table as input and readout),
MLA and MoE layers are not covered (their parameter classes differ) and are refused.
"""

from __future__ import annotations

import math


def width_mult(cfg) -> float:
  """m = d_model / mup_base_width (1 under SP)."""
  return cfg.d_model / cfg.mup_base_width if cfg.mup_base_width else 1.0


def hidden_init_std(cfg) -> float:
  """The init std of hidden matrices: init_std / sqrt(m)."""
  return cfg.init_std / math.sqrt(width_mult(cfg))


def softmax_scale(cfg) -> float:
  """Attention's q.k scale: config.attn_scale if set; 1/sqrt(H) under SP; sqrt(H_base)/H
  under µP."""
  if cfg.attn_scale is not None:
    return cfg.attn_scale
  H = cfg.resolved_head_dim
  if not cfg.mup_base_width:
    return H ** -0.5
  base = cfg.head_dim if cfg.head_dim is not None else cfg.mup_base_width // cfg.num_heads
  return math.sqrt(base) / H


def output_multiplier(cfg) -> float:
  return 1.0 / width_mult(cfg)


def validate(cfg) -> None:
  """ValueError naming the field where µP does not apply (called by ModelConfig)."""
  def need(cond: bool, field: str, msg: str):
    if not cond:
      raise ValueError(f"ModelConfig.{field}={getattr(cfg, field)!r}: {msg}")

  need(isinstance(cfg.mup_base_width, int) and cfg.mup_base_width >= 0, "mup_base_width",
       "must be an integer >= 0 (0: the standard parametrisation)")
  if not cfg.mup_base_width:
    return
  need(not cfg.tie_embeddings, "mup_base_width", "µP needs tie_embeddings=False (the tied "
       "table would be both the input and the 1/m readout)")
  need(cfg.attention_type != "mla" and cfg.num_experts == 0, "mup_base_width",
       "µP covers GQA attention and dense FFNs only (not MLA or MoE layers)")
  need(cfg.head_dim is not None or cfg.mup_base_width % cfg.num_heads == 0, "mup_base_width",
       f"must be divisible by num_heads={cfg.num_heads} (the base width's head dim)")

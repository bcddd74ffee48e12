"""Training FLOPs per token and MFU: the one formula behind every MFU in this project.

    flops_per_token = 6 * P_matmul + 12 * n_layers * N * H * S_eff
    MFU = tokens_per_s * flops_per_token / num_devices / peak_flops_per_device

- P_matmul: parameters that take part in a matmul for one token: per layer
  the q, k, v, o projections (D*N*H + 2*D*K*H + N*H*D), the FFN (3*D*F when
  gated, 2*D*F otherwise) or, in MoE layers, the router (D*E) plus R routed
  experts and the shared experts; plus the output projection D*V (also when
  tied to the embedding). The embedding lookup and norms are not matmuls.
  6 = 2 (multiply-add) * 3 (forward, and the backward's two matmuls).
- Attention scores and the weighted sum of values: 2 * 2 * N * H FLOPs per
  (query, key) pair in the forward pass, times 3 for training = 12 * N * H.
  MLA (attention_type="mla", trained with expanded keys and values): its
  projections are P_matmul's (q or q latent + up, kv latent + rope key, key / value
  up-projections, output), and a pair costs 2 * N * (qk_nope + qk_rope + v) forward.
- S_eff: keys each query attends to, on average. Causal halving IS applied:
  with causal masking a query at slot i sees i + 1 keys, so S_eff = (L + 1)/2
  (capped by the sliding window; with an attention_pattern, the mean over layers
  of each layer's S_eff). Pass causal=False for the PaLM-style count with S_eff = L.

Dropped MoE tokens are counted as computed (capacity is what the hardware
does); this is the convention of MaxText and the Switch paper's reporting.

MFU is per device, as MaxText's per_device_tflops_per_sec / peak: the job's
FLOP/s are split over its devices and compared with ONE device's peak (both
`hardware.peak_flops` and train/metrics.py's measured matmul peak are per device).
"""

from __future__ import annotations

from model.config import ModelConfig
from model.layers import is_gated


def _ffn_params(cfg: ModelConfig, hidden: int) -> int:
  return (3 if is_gated(cfg.ffn) else 2) * cfg.d_model * hidden


def _attention_params(cfg: ModelConfig) -> int:
  D, N, K, H = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
  if cfg.attention_type != "mla":
    return D * N * H + 2 * D * K * H + N * H * D
  # MLA as trained (model/attention/mla.py): queries (through the q latent when q_lora_rank > 0),
  # the kv latent and shared rope key, the per-head key / value up-projections, output.
  Q, A, Hn, P, U = cfg.mla_dims
  q = (D * Q + Q * N * (Hn + P)) if Q else D * N * (Hn + P)
  return q + D * (A + P) + A * N * (Hn + U) + N * U * D


def _score_dims(cfg: ModelConfig) -> int:
  """Per (query, key) pair, forward: the q.k width plus the value width, per head, summed
  over heads (halved FLOPs of the two attention matmuls)."""
  if cfg.attention_type != "mla":
    return 2 * cfg.num_heads * cfg.resolved_head_dim
  _, _, Hn, P, U = cfg.mla_dims
  return cfg.num_heads * (Hn + P + U)


def matmul_params_per_token(cfg: ModelConfig) -> int:
  """Parameters multiplied with each token's activations (active params)."""
  D, attn = cfg.d_model, _attention_params(cfg)
  total = D * cfg.vocab_size
  for layer in range(cfg.num_layers):
    total += attn
    if cfg.is_moe_layer(layer):
      total += D * cfg.num_experts
      total += (cfg.experts_per_token + cfg.num_shared_experts) * _ffn_params(
          cfg, cfg.resolved_expert_mlp_dim)
    else:
      total += _ffn_params(cfg, cfg.mlp_dim)
  return total


def quantized_params_per_token(cfg: ModelConfig) -> int:
  """The active parameters model.quantization's dots multiply (model/quantization.py):
  every projection and expert, not the router, nor the head unless quantize_head."""
  moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
  head = 0 if cfg.quantize_head else cfg.d_model * cfg.vocab_size
  return matmul_params_per_token(cfg) - head - moe_layers * cfg.d_model * cfg.num_experts


def _keys_per_query(window: int, seq_len: int, causal: bool) -> float:
  if not causal:
    return float(min(seq_len, window or seq_len))
  if window and window < seq_len:
    # Slots 0..w-1 see i+1 keys, the remaining L-w see w keys.
    return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len
  return (seq_len + 1) / 2


def attention_keys_per_query(cfg: ModelConfig, seq_len: int, causal: bool = True) -> float:
  """S_eff, averaged over layers (each with its own window: ModelConfig.layer_kind)."""
  windows = [cfg.layer_kind(i).window for i in range(cfg.num_layers)]
  if len(set(windows)) == 1:  # The exact single-window figure, not a mean of copies.
    return _keys_per_query(windows[0], seq_len, causal)
  return sum(_keys_per_query(w, seq_len, causal) for w in windows) / len(windows)


def training_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True) -> float:
  """FLOPs of one training step (forward + backward) per token."""
  attn = 6 * cfg.num_layers * _score_dims(cfg) * attention_keys_per_query(cfg, seq_len, causal)
  return 6 * matmul_params_per_token(cfg) + attn


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops_per_device: float,
        num_devices: int) -> float:
  """Model FLOPs utilisation: the job's FLOP/s per device over one device's peak."""
  if not peak_flops_per_device > 0:  # Also catches NaN.
    raise ValueError(f"peak_flops_per_device must be positive, got {peak_flops_per_device}")
  if not num_devices > 0:
    raise ValueError(f"num_devices must be positive, got {num_devices}")
  return tokens_per_s * flops_per_token / num_devices / peak_flops_per_device

"""blockwork.model: pure Flax (linen) decoder-only Transformer.

Shape-suffix legend (used in every name and einsum in this project):
  B batch, L query length, S key/value length, D model width, N query heads,
  K KV heads, G query heads per KV head (N = K*G), H head dim, F FFN hidden,
  V vocab, E experts, C expert capacity, R experts chosen per token (top-k),
  T tokens in a routing group.
  MLA (model/attention/mla.py) adds Q / A query / KV latent ranks, P rope dims, U value head dim.
  Outside the model's activations: Y layers (per-layer MoE metrics), J batches (eval
  batch lists), O devices of the expert axis and X experts on one device
  (parallel/expert.py).
"""

from model.config import ModelConfig
from model.transformer import Transformer

__all__ = ["ModelConfig", "Transformer"]

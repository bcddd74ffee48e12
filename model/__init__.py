"""blockwork.model: pure Flax (linen) decoder-only Transformer.

Shape-suffix legend (used in every name and einsum in this project):
  B batch, L query length, S key/value length, D model width, N query heads,
  K KV heads, G query heads per KV head (N = K*G), H head dim, F FFN hidden,
  V vocab, E experts, C expert capacity, R experts chosen per token (top-k),
  T tokens in a routing group.
"""

from model.config import ModelConfig
from model.transformer import Transformer

__all__ = ["ModelConfig", "Transformer"]

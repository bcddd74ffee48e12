"""blockwork.model: pure Flax (linen) decoder-only Transformer.

Shape-suffix legend: THE one for the project (DESIGN.md), one meaning per letter in every
name and einsum; other packages use other letters, not these with other meanings.
  B batch, L query length (a prompt's length when prefilling), S key/value length,
  D model width, N query heads, K KV heads, G query heads per KV head (N = K*G),
  H head dim, F FFN hidden, V vocab, E experts, C expert capacity,
  R experts chosen per token (top-k), T tokens in a routing group.
  P the dims RoPE rotates (model/positional.py rotary_dim; MLA's decoupled rope dims).
  M layers in one period of the layer patterns (model/transformer.py).
  MLA (model/attention/mla.py) adds Q / A query / KV latent ranks, U value head dim,
  I = H + P (a query / key head), Z = A + P (one cache row), W = max(H + P, U).
  Outside the model's activations: Y layers (per-layer MoE metrics), J batches (eval
  batch lists), O devices of the expert axis and X experts on one device
  (parallel/expert.py).
  Named in words, not letters: a ring cache's entries (model/attention/kv_cache.py).
  Lowercase letters are local to one file and declared there: f rope / sinusoidal
  frequencies (model/positional.py), p (token, expert) pairs sorted by expert and g
  blocks of b rows (model/moe/grouped.py, model/moe/dispatch.py).
"""

from model.config import ModelConfig
from model.transformer import Transformer

__all__ = ["ModelConfig", "Transformer"]

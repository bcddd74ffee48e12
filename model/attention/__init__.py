"""Attention layers and the score implementations they share.

  gqa.py        the MHA / GQA / MQA layer (`Attention`), the implementation table
                IMPLS and `resolve_attention_impl` ("auto")
  mla.py        multi-head latent attention (DeepSeek-V2/V3), the same table
  scores.py     the score hook every implementation shares: AttnSpec, masks, score biases
                (ALiBi), soft-cap
  reference.py  the attention inputs (AttnData) and the reference einsum implementation
                ("xla")
  blockwise.py  flash attention in pure JAX ("blockwise": online softmax over blocks)
  kernels.py    vendor kernels: cuDNN (GPU) and Pallas Splash (TPU)
"""

from model.attention.gqa import IMPLS, Attention, resolve_attention_impl
from model.attention.mla import MLA

__all__ = ["Attention", "IMPLS", "MLA", "resolve_attention_impl"]

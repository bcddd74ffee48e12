"""Attention layers and the score implementations they share.

  gqa.py        the MHA / GQA / MQA layer (`Attention`)
  mla.py        multi-head latent attention (DeepSeek-V2/V3)
  impls.py      the implementation table IMPLS, `resolve_attention_impl` ("auto") and
                `layer_impl`, the one place both layers pick their entry
  kv_cache.py   the one KV-cache writer (GQA's global and ring-buffer caches, MLA's rows)
  scores.py     the score hook every implementation shares: AttnSpec, masks, score biases
                (ALiBi), soft-cap
  reference.py  the attention inputs (AttnData) and the reference einsum implementation
                ("xla")
  blockwise.py  flash attention in pure JAX ("blockwise": online softmax over blocks)
  kernels.py    vendor kernels: cuDNN (GPU) and Pallas Splash (TPU)
  ring.py       ring attention ("ring"): the per-shard math of context parallelism
                (collectives in parallel/context.py)
"""

from model.attention.gqa import Attention
from model.attention.impls import IMPLS, resolve_attention_impl
from model.attention.mla import MLA

__all__ = ["Attention", "IMPLS", "MLA", "resolve_attention_impl"]

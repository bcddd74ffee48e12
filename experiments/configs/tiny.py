"""The default experiment (`make train`): a small byte-level Llama-style model on
Shakespeare, a few minutes on a 2-core CPU.

4 layers, d_model 128, 4 heads (GQA with 2 KV heads), SwiGLU, RoPE, bfloat16
compute (the fast matmul path on CPUs with AMX, and on every accelerator),
sequence 128, batch 32, 600 AdamW steps with warmup + cosine.
"""

from experiments.configs import base


def get_config(arg: str | None = None):
  c = base.get_config(arg)
  c.name = "tiny"
  if not base.parse_arg(arg, smoke=False).smoke:
    c.model.update(num_kv_heads=2, dtype="bfloat16")
  return c

"""The default experiment (`make train`): a small byte-level Llama-style model on
Shakespeare, a few minutes on a 2-core CPU.

4 layers, d_model 128, 4 heads (GQA with 2 KV heads), SwiGLU, RoPE, bfloat16
compute (the fast matmul path on CPUs with AMX, and on every accelerator),
sequence 128, batch 16, 500 AdamW steps with warmup + cosine (1M tokens).
"""

from experiments.configs import base


def get_config(arg: str | None = None):
  a = base.parse_arg(arg, **base.ARGS)  # tiny adds no arguments of its own.
  c = base.get_config(a)
  c.name = "tiny"
  if not a.smoke:
    # scan_unroll=4: the 4 layers unrolled, the same numbers, faster steps on CPU
    # (docs/PERFORMANCE.md, "Second round").
    c.model.update(num_kv_heads=2, dtype="bfloat16", scan_unroll=4)
    c.data.batch_size = 16
    c.train.steps = 500
    c.train.eval_every = 250
    c.train.checkpoint_every = 250
  return c

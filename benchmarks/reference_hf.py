"""The reference a user would otherwise pick: Hugging Face transformers on PyTorch (CPU).

LlamaForCausalLM (S, M) and MixtralForCausalLM (MoE-S), randomly initialised from
the HF config that interop/hf_config.py exports for the same ModelConfig, float32,
eager, default attention implementation (SDPA). A training step is forward +
backward + global-norm clip + torch.optim.AdamW with the project's default
hyper-parameters: the same work as train/step.py. MFU uses the same FLOP count
(model/flops.py) and the same float32 matmul peak as this project's figures.

Decode: `model.generate` with its KV cache at batch 1, greedy, a LogitsProcessor
stamping the time each token's logits arrive, so per-token latency can be read at
any generated position of one call.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import numpy as np

from benchmarks import common
from benchmarks.common import Mode
from interop.hf_config import to_hf_config
from model import ModelConfig


def _torch():
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  return torch, transformers


def make_model(cfg: ModelConfig):
  """The HF model of `cfg` (Llama or Mixtral), random init, float32."""
  torch, transformers = _torch()
  hf = to_hf_config(cfg)
  config = transformers.AutoConfig.for_model(
      hf["model_type"], **{k: v for k, v in hf.items() if k != "model_type"})
  torch.manual_seed(0)
  return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def train_stepper(cfg: ModelConfig) -> tuple[Callable[[], float], dict]:
  """(one blocking forward + backward + clip + AdamW step -> loss, facts about it)."""
  torch, _ = _torch()
  model = make_model(cfg)
  model.train()
  t = common.train_config()
  opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.b1, t.b2), eps=t.eps,
                          weight_decay=t.weight_decay)
  batch = common.random_batch(cfg)
  # HF shifts the labels itself: labels = input_ids trains on the same L positions.
  ids = torch.from_numpy(np.ascontiguousarray(batch["inputs"])).long()
  kwargs = {"output_router_logits": True} if cfg.num_experts else {}

  def step() -> float:
    loss = model(input_ids=ids, labels=ids, **kwargs).loss
    loss.backward()
    if t.grad_clip:
      torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()

  info = {"arch": type(model).__name__,
          "attn_implementation": model.config._attn_implementation,  # pylint: disable=protected-access
          "torch": torch.__version__, "torch_threads": torch.get_num_threads()}
  return step, info


def _stamper():
  _, transformers = _torch()

  class Stamps(transformers.LogitsProcessor):
    """Records when each new token's logits are ready (one call per generated token)."""

    def __init__(self):
      self.times = []

    def __call__(self, input_ids, scores):
      self.times.append(time.perf_counter())
      return scores

  return Stamps()


def generate_speed(cfg: ModelConfig, mode: Mode, positions: tuple[int, int],
                   prompt_len: int, window: int = 8) -> dict:
  """Batch-1 greedy `generate` of positions[-1] new tokens after a random prompt.

  Latency at generated position p: the median gap between consecutive tokens'
  logits over the `window` tokens up to p, i.e. one forward of one token with the
  cache at about that length.
  Decode tokens/s excludes the prefill (the first token's logits come from it).
  """
  torch, transformers = _torch()
  model = make_model(cfg)
  model.eval()
  new = positions[-1]
  rng = np.random.default_rng(1)
  prompt = torch.from_numpy(rng.integers(0, cfg.vocab_size, (1, prompt_len))).long()
  mask = torch.ones_like(prompt)

  def generate(n: int):
    stamps = _stamper()
    with torch.no_grad():
      out = model.generate(prompt, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=None,
                           logits_processor=transformers.LogitsProcessorList([stamps]))
    if out.shape[1] != prompt_len + n:
      raise RuntimeError(f"generate returned {out.shape[1] - prompt_len} tokens, not {n}")
    return np.diff(np.asarray(stamps.times))  # gaps[i]: token i + 1's forward.

  generate(min(8, new))  # Warm-up: allocator, thread pool.
  reps = [generate(new) for _ in range(max(1, mode.steps // 2))]
  lat = {}
  for p in positions:  # gaps[i] is the forward that yields generated token i + 2.
    lat[p] = statistics.median(
        statistics.median(g[max(p - window, 0):min(p, len(g))]) for g in reps)
  tps = statistics.median(len(g) / g.sum() for g in reps)
  out = {"arch": type(model).__name__, "batch": 1, "prompt_len": prompt_len,
         "new_tokens": new, "decode_tokens_per_s": tps,
         "latency_ms": {str(p): 1e3 * v for p, v in lat.items()},
         "latency_ratio": lat[positions[-1]] / lat[positions[0]]}
  print(f"reference generate B=1: {tps:.0f} tok/s, latency " + ", ".join(
      f"@{p} {1e3 * v:.2f} ms" for p, v in lat.items()), flush=True)
  return out

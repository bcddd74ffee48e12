"""Analysis probes of a model's forward pass, outside the train step: activation RMS per
layer (µP's coordinate check, experiments/coord_check.py) and the max attention logit per
layer (the stability sweep, experiments/stability_probe.py), from parameters alone.

    from experiments import probes
    from train import load_run
    run = load_run("runs/stability/base-lr0.1-s0")
    tokens_BL = probes.text_tokens(run.tokenizer, batch=8, seq_len=64)
    probes.attention_logit_max(run.model_config, run.variables["params"], tokens_BL)
    probes.activation_rms(run.model_config, run.variables["params"], tokens_BL)

Both run the model unscanned (`scan_layers=False`: the same numbers, one module per
layer) with flax's `capture_intermediates`, on dense GQA layers (not MLA or MoE).
"""

from __future__ import annotations

import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from model import ModelConfig, Transformer, mup, positional
from model.transformer import unstack_layers
from train.data.corpora import split_shakespeare

_LAYER = re.compile(r"^layer_(\d+)$")


def text_tokens(tokenizer, batch: int, seq_len: int, num_val_works: int = 4) -> np.ndarray:
  """tokens_BL [batch, seq_len] int32: consecutive windows of the held-out Shakespeare
  (train/data/corpora.py's validation works), encoded by `tokenizer`."""
  _, val = split_shakespeare(num_val_works)
  ids = np.asarray(tokenizer.encode("\n".join(val.texts)[:4 * batch * seq_len + 1024]), np.int32)
  if ids.size < batch * seq_len:
    raise ValueError(f"text_tokens: {ids.size} tokens, fewer than batch x seq_len = "
                     f"{batch} x {seq_len}")
  return ids[:batch * seq_len].reshape(batch, seq_len)


def _unscanned(cfg: ModelConfig, params) -> tuple[ModelConfig, dict]:
  if cfg.attention_type == "mla" or cfg.num_experts:
    raise ValueError("probes cover dense GQA layers only (attention_type='mla' or "
                     "num_experts > 0 given)")
  params = nn.unbox(params)
  return (cfg.replace(scan_layers=False, remat="none"),
          unstack_layers(cfg, params) if cfg.scan_layers else params)


def capture(cfg: ModelConfig, params, tokens_BL) -> tuple[jax.Array, dict]:
  """(logits_BLV, intermediates): every submodule's `__call__` output, keyed by path
  ("layer_0/attn/q"), plus the sown `embedded_BLD` (tokens + positions)."""
  chex.assert_rank(tokens_BL, 2)
  cfg, params = _unscanned(cfg, params)
  logits_BLV, state = Transformer(cfg).apply({"params": params}, jnp.asarray(tokens_BL),
                                             capture_intermediates=True,
                                             mutable=["intermediates"])
  flat: dict = {}
  _flatten(state["intermediates"], "", flat)
  return logits_BLV, flat


def _flatten(tree: dict, prefix: str, out: dict) -> None:
  """Each entry's first recorded value (a call's output; a block's (x, None): x)."""
  for key, value in tree.items():
    if isinstance(value, dict):
      _flatten(value, f"{prefix}{key}/", out)
      continue
    first = value[0]
    name = prefix.rstrip("/") if key == "__call__" else prefix + key
    out[name] = first[0] if isinstance(first, tuple) else first


def _rms(x) -> float:
  x = jnp.asarray(x, jnp.float32)
  return float(jnp.sqrt(jnp.mean(x * x)))


def activation_rms(cfg: ModelConfig, params, tokens_BL) -> dict[str, float]:
  """RMS over every coordinate of: the embedding output (`embed`), each layer's attention
  and FFN outputs (`layer_i/attn`, `layer_i/ffn`) and residual stream after it
  (`layer_i`), and the logits (`logits`): µP keeps each O(1) as width grows."""
  logits_BLV, inter = capture(cfg, params, tokens_BL)
  out = {"embed": _rms(inter["embedded_BLD"])}
  for i in range(cfg.num_layers):
    for part in ("attn", "ffn"):
      out[f"layer_{i}/{part}"] = _rms(inter[f"layer_{i}/{part}"])
    out[f"layer_{i}"] = _rms(inter[f"layer_{i}"])
  out["logits"] = _rms(logits_BLV)
  return out


def attention_logits(cfg: ModelConfig, params, tokens_BL) -> list[jax.Array]:
  """Per layer, logits_BNLS: scale x q.k after qk-norm and RoPE, soft-capped when
  attn_logit_softcap is set (what the softmax takes), -inf where the causal mask hides."""
  _, inter = capture(cfg, params, tokens_BL)
  B, L = tokens_BL.shape
  positions_BL = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
  causal_LS = jnp.tril(jnp.ones((L, L), bool))
  out = []
  for i in range(cfg.num_layers):
    pre = f"layer_{i}/attn"
    q_BLNH = inter[f"{pre}/q_norm" if cfg.qk_norm else f"{pre}/q"]
    k_BLKH = inter[f"{pre}/k_norm" if cfg.qk_norm else f"{pre}/k"]
    if cfg.layer_kind(i).rope:
      q_BLNH = positional.apply_rope(q_BLNH, positions_BL, cfg, L)
      k_BLKH = positional.apply_rope(k_BLKH, positions_BL, cfg, L)
    k_BLNH = jnp.repeat(k_BLKH, cfg.num_groups, axis=2)  # Head n reads kv head n // G.
    s_BNLS = mup.softmax_scale(cfg) * jnp.einsum("blnh,bsnh->bnls", q_BLNH, k_BLNH,
                                                 preferred_element_type=jnp.float32)
    if cfg.attn_logit_softcap:
      s_BNLS = cfg.attn_logit_softcap * jnp.tanh(s_BNLS / cfg.attn_logit_softcap)
    out.append(jnp.where(causal_LS, s_BNLS, -jnp.inf))
  return out


def attention_logit_max(cfg: ModelConfig, params, tokens_BL) -> list[float]:
  """Per layer, the largest attention logit over the batch, heads and the causally
  visible (query, key) pairs (attention_logits')."""
  return [float(jnp.max(s)) for s in attention_logits(cfg, params, tokens_BL)]

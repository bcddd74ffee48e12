"""Hugging Face tensors <-> blockwork variables, both ways, exactly.

Every family is first brought to one canonical, Llama-style naming per layer
(`self_attn.q_proj.weight`, `mlp.gate_proj.weight`, `mlp.experts.{e}.up_proj.weight`,
...): Phi-3's fused qkv / gate_up projections are split, Mixtral's w1/w3/w2 renamed,
transformers 5's fused expert tensors (`experts.gate_up_proj` [E,2F,D]) split. Export
writes the per-expert names that save_pretrained writes.
The canonical tensors then map onto one layer's params by transposes and
reshapes only, so a round trip returns bit-identical tensors.

torch `nn.Linear` stores [out, in]; blockwork's Einsum weights are [in, out]
with heads split out: q [D,N,H], k/v [D,K,H], o [N,H,D], FFN wi/wg [D,F], wo [F,D].
DeepSeek's multi-head latent attention maps in interop/hf_mla.py.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import jax
import numpy as np

from interop import hf_mla, hf_moe
from model.config import ModelConfig
from model.transformer import (abstract_variables, layer_segments, stack_layers,
                               unstack_layers)
from train.metrics import progress

Tensors = dict[str, np.ndarray]
LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MIXTRAL = (("block_sparse_moe.gate.", "mlp.gate."),
            ("block_sparse_moe.experts.", "mlp.experts."))
_MIXTRAL_W = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


# Family naming <-> canonical naming ---------------------------------------------


def to_canonical(arch: str, cfg: ModelConfig, tensors: Tensors) -> Tensors:
  out = {}
  N, K, H, F = cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim, cfg.mlp_dim
  for name, x in tensors.items():
    if arch == "Phi3ForCausalLM" and name.endswith("self_attn.qkv_proj.weight"):
      base = name[:-len("qkv_proj.weight")]
      q, k, v = np.split(x, [N * H, (N + K) * H], axis=0)
      out.update({base + "q_proj.weight": q, base + "k_proj.weight": k,
                  base + "v_proj.weight": v})
    elif arch == "Phi3ForCausalLM" and name.endswith("mlp.gate_up_proj.weight"):
      base = name[:-len("gate_up_proj.weight")]
      out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = np.split(x, [F], axis=0)
    elif name.endswith("mlp.experts.gate_up_proj"):  # transformers 5's in-memory layout:
      half = x.shape[1] // 2  # [E, 2F, D], gate rows first.
      base = name[:-len("gate_up_proj")]
      for e in range(x.shape[0]):
        out[f"{base}{e}.gate_proj.weight"] = x[e, :half]
        out[f"{base}{e}.up_proj.weight"] = x[e, half:]
    elif name.endswith("mlp.experts.down_proj"):  # [E, D, F].
      for e in range(x.shape[0]):
        out[f"{name[:-len('down_proj')]}{e}.down_proj.weight"] = x[e]
    elif arch == "MixtralForCausalLM" and "block_sparse_moe." in name:
      for old, new in _MIXTRAL:
        name = name.replace(old, new)
      out[re.sub(r"\.(w[123])\.weight$", lambda m: f".{_MIXTRAL_W[m[1]]}.weight", name)] = x
    else:
      out[name] = x
  return out


def from_canonical(arch: str, tensors: Tensors) -> Tensors:
  out = dict(tensors)
  if arch == "Phi3ForCausalLM":
    for name in [n for n in out if n.endswith("self_attn.q_proj.weight")]:
      base = name[:-len("q_proj.weight")]
      out[base + "qkv_proj.weight"] = np.concatenate(
          [out.pop(base + p + "_proj.weight") for p in "qkv"], axis=0)
    for name in [n for n in out if n.endswith("mlp.gate_proj.weight")]:
      base = name[:-len("gate_proj.weight")]
      out[base + "gate_up_proj.weight"] = np.concatenate(
          [out.pop(base + "gate_proj.weight"), out.pop(base + "up_proj.weight")], axis=0)
  elif arch == "MixtralForCausalLM":
    renamed = {}
    for name, x in out.items():
      for old, new in _MIXTRAL:
        name = name.replace(new, old)
      inv = {v: k for k, v in _MIXTRAL_W.items()}
      renamed[re.sub(r"\.experts\.(\d+)\.(\w+_proj)\.weight$",
                     lambda m: f".experts.{m[1]}.{inv[m[2]]}.weight", name)] = x
    out = renamed
  return out


# One layer -----------------------------------------------------------------------


def _attn_to_params(get: Callable[[str], np.ndarray], cfg: ModelConfig) -> dict:
  if cfg.attention_type == "mla":  # DeepSeek-V2/V3.
    return hf_mla.attn_to_params(get, cfg)
  D, N, K, H = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
  attn = {"q": {"w": get("self_attn.q_proj.weight").T.reshape(D, N, H)},
          "k": {"w": get("self_attn.k_proj.weight").T.reshape(D, K, H)},
          "v": {"w": get("self_attn.v_proj.weight").T.reshape(D, K, H)},
          "o": {"w": get("self_attn.o_proj.weight").T.reshape(N, H, D)}}
  if cfg.attn_bias:
    for p, heads in (("q", N), ("k", K), ("v", K)):
      attn[f"{p}_bias"] = {"b": get(f"self_attn.{p}_proj.bias").reshape(heads, H)}
  if cfg.qk_norm:
    attn["q_norm"] = {"scale": get("self_attn.q_norm.weight")}
    attn["k_norm"] = {"scale": get("self_attn.k_norm.weight")}
  return attn


def _attn_to_hf(attn: dict, cfg: ModelConfig) -> Tensors:
  if cfg.attention_type == "mla":
    return hf_mla.attn_to_hf(attn, cfg)
  D = cfg.d_model
  out = {"self_attn.q_proj.weight": attn["q"]["w"].reshape(D, -1).T,
         "self_attn.k_proj.weight": attn["k"]["w"].reshape(D, -1).T,
         "self_attn.v_proj.weight": attn["v"]["w"].reshape(D, -1).T,
         "self_attn.o_proj.weight": attn["o"]["w"].reshape(-1, D).T}
  if cfg.attn_bias:
    for p in "qkv":
      out[f"self_attn.{p}_proj.bias"] = attn[f"{p}_bias"]["b"].reshape(-1)
  if cfg.qk_norm:
    out["self_attn.q_norm.weight"] = attn["q_norm"]["scale"]
    out["self_attn.k_norm.weight"] = attn["k_norm"]["scale"]
  return out


def _ffn_to_params(get, prefix: str = "mlp.") -> dict:
  return {"wg": {"w": get(prefix + "gate_proj.weight").T},
          "wi": {"w": get(prefix + "up_proj.weight").T},
          "wo": {"w": get(prefix + "down_proj.weight").T}}


def _ffn_to_hf(ffn: dict, prefix: str = "mlp.") -> Tensors:
  return {prefix + "gate_proj.weight": ffn["wg"]["w"].T,
          prefix + "up_proj.weight": ffn["wi"]["w"].T,
          prefix + "down_proj.weight": ffn["wo"]["w"].T}


def layer_to_variables(get, cfg: ModelConfig, is_moe: bool) -> tuple[dict, dict]:
  """(params, model_state) of one Block from its canonical tensors (`get(name)`)."""
  params = {"attn": _attn_to_params(get, cfg),
            "norm1": {"scale": get("input_layernorm.weight")},
            "norm2": {"scale": get("post_attention_layernorm.weight")}}
  state = {}
  if is_moe:
    params["ffn"], state = hf_moe.moe_to_variables(get, cfg)
  else:
    params["ffn"] = _ffn_to_params(get)
  return params, state


def layer_to_hf(params: dict, state: dict, cfg: ModelConfig, is_moe: bool) -> Tensors:
  out = {**_attn_to_hf(params["attn"], cfg),
         "input_layernorm.weight": params["norm1"]["scale"],
         "post_attention_layernorm.weight": params["norm2"]["scale"]}
  if is_moe:
    out.update(hf_moe.moe_to_hf(params["ffn"], state, cfg))
  else:
    out.update(_ffn_to_hf(params["ffn"]))
  return out


# The whole model -------------------------------------------------------------------


def _put_state(state: dict, name: str, tree: dict):
  for collection, sub in tree.items():  # {"moe_state": {"ffn": ...}} per layer.
    state.setdefault(collection, {})[name] = sub


def hf_to_variables(tensors: Tensors, cfg: ModelConfig, arch: str,
                    dtype: Any = None) -> tuple[dict, dict]:
  """(params, model_state) for Transformer(cfg) from an HF state dict (numpy)."""
  tensors = to_canonical(arch, cfg, tensors)
  used: set[str] = set()
  cast = (lambda x: np.asarray(x, dtype)) if dtype is not None else np.asarray

  def getter(prefix: str):
    def get(name: str) -> np.ndarray:
      key = prefix + name
      if key not in tensors:
        raise ValueError(f"HF checkpoint: missing tensor {key!r} (needed by {arch} with "
                         f"this config)")
      used.add(key)
      return cast(tensors[key])
    return get

  _check_top_shapes(tensors, cfg)
  get = getter("")
  params: dict = {"embedder": {"embedding": get("model.embed_tokens.weight")},
                  "final_norm": {"scale": get("model.norm.weight")}}
  if not cfg.tie_embeddings:
    params["embedder"]["unembed"] = {"w": get("lm_head.weight").T}
  state: dict = {}
  layers = [(i, is_moe) for _, first, n, is_moe in layer_segments(cfg)
            for i in range(first, first + n)]
  # Each layer reads its tensors from the memory-mapped files: the import's slow part.
  for i, is_moe in progress(layers, len(layers), "importing layers", unit="layer"):
    p, s = _layer(getter(f"model.layers.{i}."), cfg, is_moe, i)
    params[f"layer_{i}"] = p
    _put_state(state, f"layer_{i}", s)
  if cfg.scan_layers:  # The layout Transformer(cfg) has (model/transformer.py).
    params = stack_layers(cfg, params)
    state = {c: stack_layers(cfg, sub) for c, sub in state.items()}
  unused = sorted(k for k in tensors if k not in used and not _ignorable(k, cfg))
  if unused:
    raise ValueError(f"HF checkpoint: {len(unused)} tensor(s) the {arch} config does not "
                     f"explain, e.g. {unused[:4]} (would be dropped silently)")
  return params, state


def _check_top_shapes(tensors: Tensors, cfg: ModelConfig) -> None:
  """The embedding, final norm and output head have the shapes the config says, else an
  error naming the file's tensor (a transposed lm_head.weight would otherwise surface as
  a mismatch of blockwork's params/embedder/unembed/w)."""
  V, D = cfg.vocab_size, cfg.d_model
  want = {"model.embed_tokens.weight":
              ((V, D), "[vocab_size, hidden_size]", "embedder/embedding"),
          "model.norm.weight": ((D,), "[hidden_size]", "final_norm/scale")}
  if not cfg.tie_embeddings:
    want["lm_head.weight"] = ((V, D), "[vocab_size, hidden_size]", "embedder/unembed/w")
  for name, (shape, dims, ours) in want.items():
    got = tuple(np.shape(tensors[name])) if name in tensors else shape
    if got != shape:
      hint = " (transposed?)" if got == shape[::-1] else ""
      raise ValueError(f"HF checkpoint: tensor {name!r} has shape {got}{hint}; the config "
                       f"(vocab_size={V}, hidden_size={D}) needs {shape} {dims} for "
                       f"blockwork's {ours}")


def _layer(get, cfg: ModelConfig, is_moe: bool, i: int) -> tuple[dict, dict]:
  try:
    return layer_to_variables(get, cfg, is_moe)
  except ValueError as e:  # numpy's reshape error does not say which tensor.
    if str(e).startswith("HF checkpoint"):
      raise
    raise ValueError(f"HF checkpoint: layer {i}'s tensors do not fit the config "
                     f"({type(e).__name__}: {e})") from e


def check_shapes(params: dict, model_state: dict, cfg: ModelConfig) -> None:
  """Raises naming every variable whose shape differs from Transformer(cfg).init's."""

  want = abstract_variables(cfg)
  flat = lambda t: {jax.tree_util.keystr(k): tuple(np.shape(x))
                    for k, x in jax.tree_util.tree_flatten_with_path(t)[0]}
  want, got = flat(want), flat({"params": params, **model_state})
  bad = [f"{k}: model {want.get(k)}, converted {got.get(k)}"
         for k in sorted(set(want) | set(got)) if want.get(k) != got.get(k)]
  if bad:
    raise ValueError(f"converted variables do not fit Transformer(cfg): {bad[:6]}")


def _ignorable(name: str, cfg: ModelConfig) -> bool:
  # Multi-token-prediction layers (GLM-4.5, DeepSeek-V3) sit past num_layers: inference
  # and this model's training ignore them, as HF's CausalLM does. Rotary caches are buffers.
  m = LAYER.match(name)
  return bool(m and int(m[1]) >= cfg.num_layers) or name.endswith("rotary_emb.inv_freq") or (
      cfg.tie_embeddings and name == "lm_head.weight")


def variables_to_hf(params: dict, model_state: dict, cfg: ModelConfig, arch: str) -> Tensors:
  """The HF state dict (numpy, family naming) of Transformer(cfg) variables."""
  params = _to_numpy(params)
  model_state = _to_numpy(model_state or {})
  out = {"model.embed_tokens.weight": params["embedder"]["embedding"],
         "model.norm.weight": params["final_norm"]["scale"]}
  if not cfg.tie_embeddings:
    out["lm_head.weight"] = params["embedder"]["unembed"]["w"].T
  if cfg.scan_layers:
    params = unstack_layers(cfg, params)
    model_state = {c: unstack_layers(cfg, sub) for c, sub in model_state.items()}
  for _, first, n, is_moe in layer_segments(cfg):
    for i in range(first, first + n):
      key = f"layer_{i}"
      p = params[key]
      s = {c: sub[key] for c, sub in model_state.items() if key in sub}
      for k, x in layer_to_hf(p, s, cfg, is_moe).items():
        out[f"model.layers.{i}.{k}"] = x
  return {k: np.ascontiguousarray(v) for k, v in from_canonical(arch, out).items()}


def _to_numpy(tree: Any) -> Any:
  """Plain nested dicts of numpy arrays (unboxes nn.Partitioned, unfreezes)."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  tree = nn.meta.unbox(tree)
  if hasattr(tree, "items"):
    return {k: _to_numpy(v) for k, v in tree.items()}
  return np.asarray(tree)

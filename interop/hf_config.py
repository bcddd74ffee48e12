"""Hugging Face `config.json` <-> ModelConfig.

Works on the plain JSON dict (no transformers import), in both the v4 layout
(`rope_theta`, `rope_scaling`) and the v5 one (`rope_parameters`). Whatever the
model cannot represent is refused with a ValueError naming the HF field.

Per-layer patterns: Qwen2's `layer_types` (sliding / full per layer) maps to
`attention_pattern` (its shortest repeating period) both ways; the other
families apply one sliding_window to every layer, and none has NoPE layers, so
export refuses a mixed `attention_pattern` (outside Qwen2) or any NoPE layer of
`rope_pattern`, naming the field.
"""

from __future__ import annotations

import math
from typing import Any

from interop import hf_mla
from model import positional
from model.config import ModelConfig
from model.layers import is_gated

# Architecture -> model_type. All use the Llama tensor layout (Phi-3 fuses qkv
# and gate/up, Mixtral names its experts w1/w2/w3; hf_weights handles both).
DENSE = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
         "Qwen2ForCausalLM": "qwen2", "Phi3ForCausalLM": "phi3"}
MOE = {"MixtralForCausalLM": "mixtral", "Glm4MoeForCausalLM": "glm4_moe",
       "DeepseekV3ForCausalLM": "deepseek_v3", "DeepseekV2ForCausalLM": "deepseek_v2"}
ARCHITECTURES = {**DENSE, **MOE}
# Multi-head latent attention (attention_type="mla"; interop/hf_mla.py). DeepSeek-V3's
# router is Glm4Moe's, DeepSeek-V2's a softmax one; a dense MLA model exports with every
# layer dense.
MLA = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")
PARTIAL_ROTARY = ("Phi3ForCausalLM", "Glm4MoeForCausalLM")  # HF applies rope to a prefix.
ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "gelu_pytorch_tanh": "geglu",
               "gelu_new": "geglu"}  # flax nn.gelu is the tanh approximation.
FIRST_K_DENSE = {"DeepseekV3ForCausalLM": 3, "DeepseekV2ForCausalLM": 0}  # HF defaults.
REFUSED: dict[str, str] = {}  # Architecture -> why (checked before the supported list).


def _refuse(field: str, value: Any, why: str):
  raise ValueError(f"HF config.{field}={value!r}: {why}")


# The numeric fields the importer reads, by the type each must have.
INTEGER_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "intermediate_size", "max_position_embeddings",
                  "head_dim", "sliding_window", "n_routed_experts", "num_local_experts",
                  "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
                  "first_k_dense_replace", "kv_lora_rank", "q_lora_rank",
                  "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
NUMBER_FIELDS = ("rms_norm_eps", "rope_theta", "initializer_range", "routed_scaling_factor")


def check_types(hf: dict) -> None:
  """Each numeric field of config.json the importer reads has its type (an integer, a
  number) or is null; else one error naming the field, its value and its type, before
  arithmetic on it says "unsupported operand type(s)"."""
  for fields, kinds, what in ((INTEGER_FIELDS, (int,), "an integer"),
                              (NUMBER_FIELDS, (int, float), "a number")):
    for field in fields:
      v = hf.get(field)
      if v is not None and (isinstance(v, bool) or not isinstance(v, kinds)):
        _refuse(field, v, f"is a {type(v).__name__}; it must be {what}")


def architecture_of(hf: dict) -> str:
  archs = hf.get("architectures") or []
  if not archs:
    by_type = {t: a for a, t in ARCHITECTURES.items()}
    if hf.get("model_type") in by_type:
      return by_type[hf["model_type"]]
    _refuse("architectures", archs, "missing, and model_type is not a supported family")
  arch = archs[0]
  if arch in REFUSED:
    _refuse("architectures", archs, REFUSED[arch])
  if arch not in ARCHITECTURES:
    _refuse("architectures", archs, f"unsupported; supported: {sorted(ARCHITECTURES)}")
  return arch


def rope_parameters(hf: dict) -> dict:
  """The rope dict in the v5 layout, whichever layout `hf` is in."""
  rp = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
  rp.setdefault("rope_type", rp.pop("type", "default"))
  rp.setdefault("rope_theta", hf.get("rope_theta", 10_000.0))
  rp.setdefault("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
  return rp


def _yarn_attention_factor(rp: dict, factor: float) -> float:
  if rp.get("attention_factor") is not None:
    return float(rp["attention_factor"])
  mscale = lambda s, m=1.0: 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0
  if rp.get("mscale") and rp.get("mscale_all_dim"):
    return float(mscale(factor, rp["mscale"]) / mscale(factor, rp["mscale_all_dim"]))
  return float(mscale(factor))


def _rope_fields(hf: dict, arch: str) -> dict:
  rp = rope_parameters(hf)
  max_pos = hf.get("max_position_embeddings", 2048)
  out = dict(rope_theta=float(rp["rope_theta"]))
  frac = float(rp["partial_rotary_factor"])
  if frac != 1.0:
    if arch not in PARTIAL_ROTARY:
      _refuse("partial_rotary_factor", frac, f"{arch} rotates the whole head in HF; only "
              f"{PARTIAL_ROTARY} support partial rotary")
    out["rope_fraction"] = frac
  kind = rp["rope_type"]
  orig = rp.get("original_max_position_embeddings") or max_pos
  if arch == "Phi3ForCausalLM" and kind in ("linear", "dynamic", "yarn", "llama3"):
    orig = hf.get("original_max_position_embeddings", orig)  # HF: Phi-3's own field wins.
  if kind == "default":
    return out
  if kind in ("linear", "dynamic"):
    # HF's dynamic NTK measures growth against max_position_embeddings.
    return {**out, "rope_scaling": "linear" if kind == "linear" else "dynamic_ntk",
            "rope_scaling_factor": float(rp["factor"]), "rope_original_max_len": max_pos}
  if kind == "yarn":
    if rp.get("truncate", True) is False:
      _refuse("rope_parameters.truncate", False, "blockwork's YaRN always truncates the "
              "correction range (HF's default)")
    factor = rp.get("factor") or max_pos / orig
    return {**out, "rope_scaling": "yarn", "rope_scaling_factor": float(factor),
            "rope_original_max_len": int(orig),
            "yarn_beta_fast": float(rp.get("beta_fast") or 32),
            "yarn_beta_slow": float(rp.get("beta_slow") or 1),
            "yarn_attn_factor": _yarn_attention_factor(rp, factor)}
  if kind == "llama3":
    return {**out, "rope_scaling": "llama3", "rope_scaling_factor": float(rp["factor"]),
            "rope_original_max_len": int(orig),
            "llama3_low_freq_factor": float(rp["low_freq_factor"]),
            "llama3_high_freq_factor": float(rp["high_freq_factor"])}
  _refuse("rope_parameters.rope_type", kind, "not implemented by model/positional.py; "
          "supported: default, linear, dynamic, yarn, llama3")


def _window_fields(hf: dict, arch: str) -> dict:
  """sliding_window, and attention_pattern where layers differ (Qwen2's layer_types)."""
  if arch == "Qwen2ForCausalLM":
    n, window = hf["num_hidden_layers"], hf.get("sliding_window") or 0
    types = hf.get("layer_types")
    if types is None:  # HF's rule before layer_types (and its default still).
      use, first = hf.get("use_sliding_window", False), hf.get("max_window_layers", 28)
      types = ["sliding_attention" if use and i >= first else "full_attention"
               for i in range(n)]
    kinds = {"sliding_attention": "local", "full_attention": "global"}
    if len(types) != n or set(types) - set(kinds):
      _refuse("layer_types", types, f"expected num_hidden_layers={n} entries of "
              f"{sorted(kinds)}")
    pattern = [kinds[t] for t in types]
    if not window or "local" not in pattern:
      return dict(sliding_window=0)
    if "global" not in pattern:
      return dict(sliding_window=window)
    # The shortest period that repeats to the layer list (at most the whole list).
    p = next(p for p in range(1, n + 1) if n % p == 0 and pattern == pattern[:p] * (n // p))
    return dict(sliding_window=window, attention_pattern=tuple(pattern[:p]))
  if arch in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM"):
    # HF applies their sliding_window to every layer (Mistral ignores layer_types).
    return dict(sliding_window=hf.get("sliding_window") or 0)
  return dict(sliding_window=0)


def _moe_fields(hf: dict, arch: str) -> dict:
  if arch == "MixtralForCausalLM":
    return dict(num_experts=hf["num_local_experts"], experts_per_token=hf["num_experts_per_tok"],
                expert_mlp_dim=hf["intermediate_size"], router_score="softmax",
                router_norm_topk=True, load_balance="aux_loss",
                aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.02)))
  if arch == "DeepseekV2ForCausalLM":
    return hf_mla.v2_moe_fields(hf)
  # Glm4Moe: the DeepSeek-V3 router.
  return dict(num_experts=hf["n_routed_experts"], experts_per_token=hf["num_experts_per_tok"],
              expert_mlp_dim=hf["moe_intermediate_size"],
              num_shared_experts=hf.get("n_shared_experts", 1),
              first_k_dense=hf.get("first_k_dense_replace", FIRST_K_DENSE.get(arch, 1)),
              router_score="sigmoid",
              router_norm_topk=bool(hf.get("norm_topk_prob", True)),
              route_scale=float(hf.get("routed_scaling_factor", 1.0)),
              router_groups=hf.get("n_group") or 1, router_topk_groups=hf.get("topk_group") or 1,
              load_balance="loss_free")


def from_hf_config(hf: dict, **overrides: Any) -> ModelConfig:
  """The ModelConfig of an HF config.json dict; `overrides` set non-architectural fields."""
  check_types(hf)
  arch = architecture_of(hf)
  act = hf.get("hidden_act", "silu")
  if act not in ACTIVATIONS:
    _refuse("hidden_act", act, f"supported: {sorted(ACTIVATIONS)}")
  for field in ("mlp_bias", "qk_layernorm"):
    if hf.get(field):
      _refuse(field, hf[field], "blockwork's FFN and QK-norm have no such variant")
  if arch == "LlamaForCausalLM" and hf.get("attention_bias"):
    _refuse("attention_bias", True, "Llama's attention_bias also biases o_proj, which "
            "blockwork's attention does not have (Qwen2's q/k/v-only bias is supported)")
  heads = hf["num_attention_heads"]
  head_dim = hf.get("head_dim")
  fields = dict(
      vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
      num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
      mlp_dim=hf["intermediate_size"], max_seq_len=hf.get("max_position_embeddings", 2048),
      head_dim=None if head_dim in (None, hf["hidden_size"] // heads) else head_dim,
      pos_encoding="rope", norm="rmsnorm", norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      norm_position="pre", ffn=ACTIVATIONS[act],
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      attn_bias=arch == "Qwen2ForCausalLM" or (arch == "Glm4MoeForCausalLM" and
                                                bool(hf.get("attention_bias"))),
      qk_norm=arch == "Glm4MoeForCausalLM" and bool(hf.get("use_qk_norm")),
      init_std=float(hf.get("initializer_range", 0.02)), **_window_fields(hf, arch),
      **_rope_fields(hf, arch))
  all_dense = arch in MLA and hf.get("first_k_dense_replace", FIRST_K_DENSE.get(arch, 1)) >= (
      hf["num_hidden_layers"])
  if arch in MOE and not all_dense:
    fields.update(_moe_fields(hf, arch), capacity_factor=0.0)  # Dropless, as HF.
  if arch in MLA:
    fields.update(hf_mla.config_fields(hf, arch))
  fields.update(overrides)
  try:
    return ModelConfig(**fields)
  except ValueError as e:
    raise ValueError(f"HF config ({arch}) is not representable: {e}") from e


# ModelConfig -> HF ---------------------------------------------------------


def _need(cond: bool, cfg: ModelConfig, field: str, why: str):
  if not cond:
    raise ValueError(f"ModelConfig.{field}={getattr(cfg, field)!r}: cannot export to "
                     f"Hugging Face: {why}")


def _windows(cfg: ModelConfig) -> list[int]:
  """Each layer's sliding window (0: full), after attention_pattern."""
  return [cfg.layer_kind(i).window for i in range(cfg.num_layers)]


def pick_architecture(cfg: ModelConfig) -> str:
  """The HF family that represents `cfg` (the first that fits, simplest first)."""
  if cfg.attention_type == "mla":
    v2 = cfg.num_experts and cfg.router_score == "softmax"
    return "DeepseekV2ForCausalLM" if v2 else "DeepseekV3ForCausalLM"
  if cfg.num_experts:
    mixtral = (cfg.router_score == "softmax" and cfg.router_norm_topk and cfg.route_scale == 1
               and cfg.router_groups == 1 and not cfg.num_shared_experts
               and not cfg.first_k_dense)
    return "MixtralForCausalLM" if mixtral else "Glm4MoeForCausalLM"
  if cfg.rope_fraction < 1:
    return "Phi3ForCausalLM"
  if cfg.attn_bias:
    return "Qwen2ForCausalLM"
  return "MistralForCausalLM" if any(_windows(cfg)) else "LlamaForCausalLM"


def _check_exportable(cfg: ModelConfig, arch: str):
  h = cfg.resolved_head_dim
  _need(cfg.pos_encoding == "rope", cfg, "pos_encoding", "the HF families use RoPE")
  _need(cfg.rope_layout == "split_half" or arch in MLA, cfg, "rope_layout",
        "HF rotates halves (rotate_half); only DeepSeek has rope_interleave")
  _need((cfg.attention_type == "mla") == (arch in MLA), cfg, "attention_type",
        f"{arch} has {'multi-head latent' if arch in MLA else 'GQA'} attention")
  _need(cfg.rope_scaling != "ntk", cfg, "rope_scaling", "static NTK has no HF rope_type")
  _need(cfg.rope_scaling != "dynamic_ntk" or cfg.rope_original_len == cfg.max_seq_len, cfg,
        "rope_original_max_len", "HF's dynamic NTK grows from max_position_embeddings")
  _need(cfg.norm == "rmsnorm", cfg, "norm", "the HF families use RMSNorm")
  _need(cfg.norm_position == "pre", cfg, "norm_position", "the HF families are pre-norm")
  _need(is_gated(cfg.ffn), cfg, "ffn", "the HF families use a gated FFN")
  _need(cfg.attn_scale in (None, h ** -0.5), cfg, "attn_scale", "HF scales by 1/sqrt(head_dim)")
  _need(not cfg.mup_base_width, cfg, "mup_base_width",
        "µP's attention and output multipliers have no HF config field")
  _need(not cfg.attn_logit_softcap, cfg, "attn_logit_softcap", "no soft-capping in these families")
  glm = arch == "Glm4MoeForCausalLM"
  _need(not cfg.qk_norm or glm, cfg, "qk_norm", f"{arch} has no QK-norm")
  _need(not cfg.attn_bias or arch == "Qwen2ForCausalLM" or glm, cfg, "attn_bias",
        f"{arch} has no q/k/v-only bias")
  _need(cfg.rope_fraction == 1 or arch in PARTIAL_ROTARY, cfg, "rope_fraction",
        f"{arch} rotates the whole head")
  windows = _windows(cfg)
  _need(not any(windows) or arch not in ("LlamaForCausalLM", "Glm4MoeForCausalLM"), cfg,
        "sliding_window", f"{arch} has no sliding window")
  _need(len(set(windows)) == 1 or arch == "Qwen2ForCausalLM", cfg, "attention_pattern",
        f"local and global layers have no {arch} config equivalent (HF applies its "
        "sliding_window to every layer); only Qwen2's layer_types (attn_bias=True) has one")
  _need(all(cfg.layer_kind(i).rope for i in range(cfg.num_layers)), cfg, "rope_pattern",
        f"NoPE layers have no {arch} config equivalent (every layer rotates)")
  _need(cfg.rope_scaling == "none" or arch != "Phi3ForCausalLM", cfg, "rope_scaling",
        "Phi-3 supports only default and longrope")
  _need(bool(cfg.num_experts) == (arch in MOE) or arch in MLA, cfg, "num_experts",
        f"{arch} is {'an MoE' if arch in MOE else 'a dense'} family")
  if arch == "MixtralForCausalLM":
    for f, ok in (("router_score", cfg.router_score == "softmax"),
                  ("router_norm_topk", cfg.router_norm_topk), ("route_scale", cfg.route_scale == 1),
                  ("router_groups", cfg.router_groups == 1),
                  ("num_shared_experts", not cfg.num_shared_experts),
                  ("first_k_dense", not cfg.first_k_dense)):
      _need(ok, cfg, f, "Mixtral routes softmax top-k, renormalised, every layer, no shared")
  if arch == "DeepseekV2ForCausalLM":
    hf_mla.check_v2_exportable(cfg, _need)
  elif glm or (arch in MLA and cfg.num_experts):
    _need(cfg.router_score == "sigmoid", cfg, "router_score", f"{arch} routes by sigmoid")
    _need(cfg.num_shared_experts > 0, cfg, "num_shared_experts", f"{arch} has a shared expert")


def _rope_scaling_dict(cfg: ModelConfig) -> dict | None:
  f = cfg.rope_scaling_factor
  if cfg.rope_scaling == "none":
    return None
  if cfg.rope_scaling in ("linear", "dynamic_ntk"):
    return {"rope_type": "linear" if cfg.rope_scaling == "linear" else "dynamic", "factor": f}
  if cfg.rope_scaling == "yarn":
    return {"rope_type": "yarn", "factor": f, "beta_fast": cfg.yarn_beta_fast,
            "beta_slow": cfg.yarn_beta_slow,
            "attention_factor": float(positional.rope_inv_freq(cfg)[1]),
            "original_max_position_embeddings": cfg.rope_original_len,
            **({"mscale_all_dim": cfg.yarn_mscale_all_dim} if cfg.yarn_mscale_all_dim else {})}
  return {"rope_type": "llama3", "factor": f, "low_freq_factor": cfg.llama3_low_freq_factor,
          "high_freq_factor": cfg.llama3_high_freq_factor,
          "original_max_position_embeddings": cfg.rope_original_len}


def to_hf_config(cfg: ModelConfig, architecture: str | None = None) -> dict:
  """config.json for `cfg` in `architecture` (default: pick_architecture)."""
  arch = architecture or pick_architecture(cfg)
  if arch not in ARCHITECTURES:
    raise ValueError(f"architecture={arch!r}: supported: {sorted(ARCHITECTURES)}")
  _check_exportable(cfg, arch)
  scaling = _rope_scaling_dict(cfg)
  rope = {"rope_type": "default", **(scaling or {}), "rope_theta": cfg.rope_theta}
  if arch in PARTIAL_ROTARY:
    rope["partial_rotary_factor"] = cfg.rope_fraction
  windows = _windows(cfg)
  sw = max(windows) or None
  hf = dict(
      architectures=[arch], model_type=ARCHITECTURES[arch], vocab_size=cfg.vocab_size,
      hidden_size=cfg.d_model, intermediate_size=cfg.mlp_dim,
      num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
      num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.resolved_head_dim,
      hidden_act="silu" if cfg.ffn == "swiglu" else "gelu_pytorch_tanh",
      max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
      initializer_range=cfg.init_std, tie_word_embeddings=cfg.tie_embeddings,
      rope_parameters=rope, rope_theta=cfg.rope_theta, rope_scaling=scaling,  # v5 and v4.
      dtype=cfg.param_dtype, torch_dtype=cfg.param_dtype,
      bos_token_id=None, eos_token_id=None, pad_token_id=None)
  if arch in PARTIAL_ROTARY:
    hf["partial_rotary_factor"] = cfg.rope_fraction
  if arch == "Qwen2ForCausalLM":
    # layer_types (transformers >= 4.53) is what says which layers slide; max_window_layers
    # is only read without it.
    hf.update(use_sliding_window=bool(sw), sliding_window=sw, max_window_layers=0,
              layer_types=["sliding_attention" if w else "full_attention" for w in windows])
  elif arch not in ("LlamaForCausalLM", "Glm4MoeForCausalLM", *MLA):
    hf["sliding_window"] = sw
  if arch == "MixtralForCausalLM":
    hf.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
              intermediate_size=cfg.resolved_expert_mlp_dim, router_jitter_noise=0.0,
              router_aux_loss_coef=cfg.aux_loss_coef)
  elif arch == "Glm4MoeForCausalLM":
    hf.update(n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
              moe_intermediate_size=cfg.resolved_expert_mlp_dim,
              n_shared_experts=cfg.num_shared_experts, first_k_dense_replace=cfg.first_k_dense,
              norm_topk_prob=cfg.router_norm_topk, routed_scaling_factor=cfg.route_scale,
              n_group=cfg.router_groups, topk_group=cfg.router_topk_groups,
              use_qk_norm=cfg.qk_norm, attention_bias=cfg.attn_bias, num_nextn_predict_layers=0)
  elif arch in MLA:
    hf.update(hf_mla.hf_fields(cfg, arch))
  return hf

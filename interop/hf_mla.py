"""One MLA attention layer: DeepSeek-V2/V3 HF tensors <-> model/attention/mla.py's MLA params.

HF (torch [out, in]): `q_proj` [N*(H+P), D] (q_lora_rank null) or `q_a_proj` [Q, D] +
`q_a_layernorm` [Q] + `q_b_proj` [N*(H+P), Q]; `kv_a_proj_with_mqa` [A+P, D] (the
latent, then the shared rope key); `kv_a_layernorm` [A]; `kv_b_proj` [N*(H+U), A] (per
head: key dims, then value dims); `o_proj` [D, N*U]. Rows of a head are [nope | rope].

blockwork ([in, out], heads split out): q_nope [D or Q, N, H], q_rope [D or Q, N, P],
q_a [D, Q], q_a_norm, kv_a [D, A], k_rope [D, P], kv_a_norm, k_up [A, N, H],
v_up [A, N, U], o [N, U, D]. Splits and concatenations only: round trips are exact.
"""

from __future__ import annotations

import numpy as np

from model.config import ModelConfig

V2 = "DeepseekV2ForCausalLM"


def _split_heads(w_in_out: np.ndarray, N: int, sizes: tuple[int, int]):
  """[in, N * (a + b)] -> ([in, N, a], [in, N, b])."""
  w = w_in_out.reshape(w_in_out.shape[0], N, sum(sizes))
  return w[..., :sizes[0]], w[..., sizes[0]:]


def _join_heads(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """([in, N, a], [in, N, b]) -> torch's [N * (a + b), in]."""
  w = np.concatenate([a, b], axis=-1)
  return w.reshape(w.shape[0], -1).T


def attn_to_params(get, cfg: ModelConfig) -> dict:
  N = cfg.num_heads
  Q, A, H, P, U = cfg.mla_dims
  attn = {}
  if Q:
    attn["q_a"] = {"w": get("self_attn.q_a_proj.weight").T}
    attn["q_a_norm"] = {"scale": get("self_attn.q_a_layernorm.weight")}
    q = get("self_attn.q_b_proj.weight").T
  else:
    q = get("self_attn.q_proj.weight").T
  q_nope, q_rope = _split_heads(q, N, (H, P))
  kv_a = get("self_attn.kv_a_proj_with_mqa.weight").T
  k_up, v_up = _split_heads(get("self_attn.kv_b_proj.weight").T, N, (H, U))
  attn.update(q_nope={"w": q_nope}, q_rope={"w": q_rope}, kv_a={"w": kv_a[:, :A]},
              k_rope={"w": kv_a[:, A:]},
              kv_a_norm={"scale": get("self_attn.kv_a_layernorm.weight")},
              k_up={"w": k_up}, v_up={"w": v_up},
              o={"w": get("self_attn.o_proj.weight").T.reshape(N, U, cfg.d_model)})
  return attn


def attn_to_hf(attn: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
  out = {}
  q = _join_heads(attn["q_nope"]["w"], attn["q_rope"]["w"])
  if cfg.mla_dims.q_lora_rank:
    out["self_attn.q_a_proj.weight"] = attn["q_a"]["w"].T
    out["self_attn.q_a_layernorm.weight"] = attn["q_a_norm"]["scale"]
    out["self_attn.q_b_proj.weight"] = q
  else:
    out["self_attn.q_proj.weight"] = q
  out["self_attn.kv_a_proj_with_mqa.weight"] = np.concatenate(
      [attn["kv_a"]["w"], attn["k_rope"]["w"]], axis=1).T
  out["self_attn.kv_a_layernorm.weight"] = attn["kv_a_norm"]["scale"]
  out["self_attn.kv_b_proj.weight"] = _join_heads(attn["k_up"]["w"], attn["v_up"]["w"])
  out["self_attn.o_proj.weight"] = attn["o"]["w"].reshape(-1, cfg.d_model).T
  return out


# config.json ---------------------------------------------------------------------


def config_fields(hf: dict, arch: str) -> dict:
  """The MLA ModelConfig fields of a DeepSeek-V2/V3 config.json (the rest is generic).
  DeepSeek-V2 always rotates interleaved pairs (complex multiplication); V3 when
  rope_interleave (its default)."""
  def refuse(field, why):
    raise ValueError(f"HF config.{field}={hf.get(field)!r}: {why}")
  heads = hf["num_attention_heads"]
  if (hf.get("num_key_value_heads") or heads) != heads:
    refuse("num_key_value_heads", f"MLA up-projects a key and value for each of the "
           f"num_attention_heads={heads} heads (HF's own attention needs them equal)")
  if hf.get("attention_bias"):
    refuse("attention_bias", "blockwork's MLA projections have no biases")
  rp = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  mscale_all_dim = float(rp.get("mscale_all_dim") or 0.0)
  if mscale_all_dim and rp.get("rope_type", rp.get("type")) != "yarn":
    refuse("rope_parameters.mscale_all_dim", "scales the softmax only with rope_type yarn here")
  return dict(attention_type="mla", num_kv_heads=heads, head_dim=None,
              q_lora_rank=hf.get("q_lora_rank") or 0, kv_lora_rank=hf["kv_lora_rank"],
              qk_nope_head_dim=hf["qk_nope_head_dim"],
              qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
              rope_layout="interleaved" if arch == V2 or hf.get("rope_interleave", True)
              else "split_half",
              yarn_mscale_all_dim=mscale_all_dim)


def v2_moe_fields(hf: dict) -> dict:
  """DeepSeek-V2's router: softmax over all experts, top-k NOT renormalised (HF ignores
  norm_topk_prob), times routed_scaling_factor, no correction bias; trained with an
  auxiliary balance loss."""
  method, groups = hf.get("topk_method") or "greedy", hf.get("n_group") or 1
  if method not in ("greedy", "group_limited_greedy") or (
      method == "group_limited_greedy" and groups > 1):
    raise ValueError(f"HF config.topk_method={method!r} (n_group={groups}): only greedy "
                     "top-k is implemented (DeepSeek-V2-Lite); group-limited greedy ranks "
                     "groups by their best expert, which blockwork's router does not")
  return dict(num_experts=hf["n_routed_experts"], experts_per_token=hf["num_experts_per_tok"],
              expert_mlp_dim=hf["moe_intermediate_size"],
              num_shared_experts=hf.get("n_shared_experts", 2),
              first_k_dense=hf.get("first_k_dense_replace", 0), router_score="softmax",
              router_norm_topk=False, route_scale=float(hf.get("routed_scaling_factor", 1.0)),
              load_balance="aux_loss")


def check_v2_exportable(cfg: ModelConfig, need) -> None:
  for f, ok in (("router_score", cfg.router_score == "softmax"),
                ("router_norm_topk", not cfg.router_norm_topk),
                ("router_groups", cfg.router_groups == 1),
                ("load_balance", cfg.load_balance != "loss_free"),
                ("num_shared_experts", cfg.num_shared_experts > 0),
                ("rope_layout", cfg.rope_layout == "interleaved")):
    need(ok, cfg, f, "DeepSeek-V2 routes softmax top-k unnormalised, ungrouped, without a "
         "bias, with shared experts, and rotates interleaved pairs")


def hf_fields(cfg: ModelConfig, arch: str) -> dict:
  """config.json fields of DeepseekV3ForCausalLM beyond the generic ones. A dense model
  is written as every layer dense (first_k_dense_replace = num_hidden_layers)."""
  Q, A, H, P, U = cfg.mla_dims
  moe = cfg.num_experts > 0
  hf = dict(q_lora_rank=Q or None, kv_lora_rank=A, qk_nope_head_dim=H, qk_rope_head_dim=P,
            v_head_dim=U, head_dim=P, num_key_value_heads=cfg.num_heads,
            rope_interleave=cfg.rope_layout == "interleaved", attention_bias=False,
            n_routed_experts=cfg.num_experts if moe else 1,
            num_experts_per_tok=cfg.experts_per_token if moe else 1,
            moe_intermediate_size=cfg.resolved_expert_mlp_dim,
            n_shared_experts=cfg.num_shared_experts if moe else 1,
            first_k_dense_replace=cfg.first_k_dense if moe else cfg.num_layers,
            norm_topk_prob=cfg.router_norm_topk, routed_scaling_factor=cfg.route_scale,
            n_group=cfg.router_groups if moe else 1,
            topk_group=cfg.router_topk_groups if moe else 1, num_nextn_predict_layers=0)
  if arch == V2:
    del hf["rope_interleave"], hf["num_nextn_predict_layers"]
    hf.update(topk_method="greedy", norm_topk_prob=False, n_group=None, topk_group=None)
  return hf

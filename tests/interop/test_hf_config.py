"""HF config.json <-> ModelConfig: field mapping, round trips, and refusals naming the field."""

import pytest

from interop.hf_config import from_hf_config, pick_architecture, to_hf_config
from model import ModelConfig

LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128,
             hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
             hidden_act="silu", tie_word_embeddings=False, rope_theta=10000.0)


def hf(**kw):
  return {**LLAMA, **kw}


def test_llama_fields_v4_and_v5_rope_layouts_agree():
  v4 = from_hf_config(hf(rope_theta=500.0, rope_scaling=dict(
      type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
      original_max_position_embeddings=16)))
  v5 = from_hf_config({k: v for k, v in hf().items() if k != "rope_theta"} | dict(
      rope_parameters=dict(rope_type="llama3", rope_theta=500.0, factor=8.0,
                           low_freq_factor=1.0, high_freq_factor=4.0,
                           original_max_position_embeddings=16)))
  assert v4 == v5
  assert (v4.d_model, v4.num_heads, v4.num_kv_heads, v4.mlp_dim, v4.norm_eps) == (
      32, 4, 2, 64, 1e-5)
  assert (v4.rope_scaling, v4.rope_scaling_factor, v4.rope_original_max_len,
          v4.rope_theta) == ("llama3", 8.0, 16, 500.0)


def test_yarn_attention_factor_follows_hf():
  import math  # pylint: disable=g-import-not-at-top
  rope = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16)
  assert from_hf_config(hf(rope_parameters=rope)).yarn_attn_factor == pytest.approx(
      0.1 * math.log(4.0) + 1)
  cfg = from_hf_config(hf(rope_parameters={**rope, "mscale": 1.0, "mscale_all_dim": 0.5}))
  assert cfg.yarn_attn_factor == pytest.approx((0.1 * math.log(4) + 1) /
                                               (0.05 * math.log(4) + 1))
  assert from_hf_config(hf(rope_parameters={**rope, "attention_factor": 0.7})
                        ).yarn_attn_factor == 0.7


def test_dynamic_ntk_grows_from_max_position_embeddings():
  cfg = from_hf_config(hf(rope_scaling=dict(type="dynamic", factor=2.0)))
  assert cfg.rope_scaling == "dynamic_ntk" and cfg.rope_original_len == 64


@pytest.mark.parametrize("cfg", [
    ModelConfig(vocab_size=128, d_model=32, num_layers=2, num_heads=4, num_kv_heads=1,
                mlp_dim=64, max_seq_len=64, tie_embeddings=True, rope_scaling="yarn",
                rope_scaling_factor=4.0, rope_original_max_len=16, yarn_attn_factor=1.2),
    ModelConfig(vocab_size=128, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                mlp_dim=64, max_seq_len=64, sliding_window=8, head_dim=16),
    ModelConfig(vocab_size=128, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                mlp_dim=64, max_seq_len=64, attn_bias=True, rope_scaling="linear",
                rope_scaling_factor=2.0, rope_original_max_len=64),
    ModelConfig(vocab_size=128, d_model=32, num_layers=2, num_heads=4, num_kv_heads=4,
                mlp_dim=64, max_seq_len=64, rope_fraction=0.5, ffn="geglu"),
], ids=["llama-yarn", "mistral-window", "qwen2-bias", "phi3-partial"])
def test_model_config_round_trips_through_hf(cfg):
  assert from_hf_config(to_hf_config(cfg)) == cfg


def test_pick_architecture():
  base = dict(vocab_size=128, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
              mlp_dim=64, max_seq_len=64)
  assert pick_architecture(ModelConfig(**base)) == "LlamaForCausalLM"
  assert pick_architecture(ModelConfig(**base, sliding_window=4)) == "MistralForCausalLM"
  assert pick_architecture(ModelConfig(**base, attn_bias=True)) == "Qwen2ForCausalLM"
  assert pick_architecture(ModelConfig(**base, rope_fraction=0.5)) == "Phi3ForCausalLM"
  assert pick_architecture(ModelConfig(**base, num_experts=4)) == "MixtralForCausalLM"
  assert pick_architecture(ModelConfig(**base, num_experts=4, router_score="sigmoid",
                                       num_shared_experts=1)) == "Glm4MoeForCausalLM"


@pytest.mark.parametrize("fields,field", [
    (dict(architectures=["DeepseekV2ForCausalLM"], topk_method="group_limited_greedy",
          n_group=4), "topk_method"),
    (dict(architectures=["GPT2LMHeadModel"]), "architectures"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(rope_scaling=dict(type="longrope", short_factor=[1.0], long_factor=[1.0])),
     "rope_type"),
    (dict(rope_scaling=dict(type="yarn", factor=2.0, truncate=False)), "truncate"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=8,
          layer_types=["sliding_attention", "chunked_attention"]), "layer_types"),
    (dict(num_key_value_heads=3), "num_kv_heads"),
])
def test_import_refuses_naming_the_field(fields, field):
  with pytest.raises(ValueError, match=field):
    from_hf_config(hf(**fields))


@pytest.mark.parametrize("fields,field", [
    (dict(pos_encoding="alibi"), "pos_encoding"),
    (dict(rope_scaling="ntk", rope_scaling_factor=2.0), "rope_scaling"),
    (dict(rope_layout="interleaved"), "rope_layout"),
    (dict(norm="layernorm"), "norm"),
    (dict(ffn="relu"), "ffn"),
    (dict(attn_logit_softcap=30.0), "attn_logit_softcap"),
    (dict(qk_norm=True), "qk_norm"),
    (dict(rope_fraction=0.5, rope_scaling="linear", rope_scaling_factor=2.0), "rope_scaling"),
])
def test_export_refuses_naming_the_field(fields, field):
  cfg = ModelConfig(vocab_size=128, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                    mlp_dim=64, max_seq_len=64, **fields)
  with pytest.raises(ValueError, match=f"ModelConfig.{field}"):
    to_hf_config(cfg)

"""Per-layer patterns and Hugging Face: Qwen2's layer_types <-> attention_pattern (config
mapping both ways, logit parity with transformers), and export refusals naming the field."""

import jax
import numpy as np
import pytest

from interop.hf_config import from_hf_config, pick_architecture, to_hf_config
from model import ModelConfig
from model.transformer import stack_layers, unstack_layers

BASE = dict(vocab_size=128, d_model=32, num_layers=4, num_heads=4, num_kv_heads=2,
            mlp_dim=64, max_seq_len=64)
QWEN2 = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=128,
             hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, hidden_act="silu",
             tie_word_embeddings=False, rope_theta=10000.0)
ALTERNATING = ["sliding_attention", "full_attention"] * 2


@pytest.mark.parametrize("fields,field,arch", [
    (dict(attention_pattern=("local", "global"), sliding_window=8), "attention_pattern",
     "MistralForCausalLM"),
    (dict(attention_pattern=("local", "global"), sliding_window=8, num_experts=4),
     "attention_pattern", "MixtralForCausalLM"),
    (dict(rope_pattern=("rope", "rope", "rope", "nope")), "rope_pattern", "LlamaForCausalLM"),
    (dict(rope_pattern=("rope", "nope"), attn_bias=True), "rope_pattern", "Qwen2ForCausalLM"),
])
def test_export_refuses_patterns_a_family_cannot_express(fields, field, arch):
  cfg = ModelConfig(**BASE, **fields)
  assert pick_architecture(cfg) == arch
  with pytest.raises(ValueError, match=f"ModelConfig.{field}=.*{arch}"):
    to_hf_config(cfg)


def test_patterns_of_one_kind_export_as_that_kind():
  # Every layer global: no window at all (Llama), whatever sliding_window says.
  hf = to_hf_config(ModelConfig(**BASE, attention_pattern=("global",), sliding_window=8))
  assert hf["architectures"] == ["LlamaForCausalLM"] and "sliding_window" not in hf
  # Every layer local: Mistral's global sliding_window.
  hf = to_hf_config(ModelConfig(**BASE, attention_pattern=("local",), sliding_window=8))
  assert hf["architectures"] == ["MistralForCausalLM"] and hf["sliding_window"] == 8


def test_qwen2_layer_types_map_to_attention_pattern_both_ways():
  cfg = ModelConfig(**BASE, attn_bias=True, sliding_window=8,
                    attention_pattern=("local", "global"))
  hf = to_hf_config(cfg)
  assert hf["layer_types"] == ALTERNATING and hf["use_sliding_window"]
  assert from_hf_config(hf) == cfg
  # HF's older rule (max_window_layers: the layers from it on slide), one period of 4.
  got = from_hf_config({**QWEN2, "use_sliding_window": True, "sliding_window": 8,
                        "max_window_layers": 3})
  assert (got.attention_pattern, got.sliding_window) == (("global",) * 3 + ("local",), 8)
  # All sliding, or sliding without a window: no pattern.
  assert from_hf_config({**QWEN2, "use_sliding_window": True, "sliding_window": 8,
                         "max_window_layers": 0}).attention_pattern == ()
  assert from_hf_config({**QWEN2, "layer_types": ALTERNATING,
                         "sliding_window": None}).sliding_window == 0


def test_qwen2_alternating_layer_types_logit_parity(tmp_path):
  """A random HF Qwen2 with sliding and full layers alternating: the imported model
  (attention_pattern) gives its logits on sequences 3x the window, and exports back."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from interop import export_hf_dir, load_hf_dir  # pylint: disable=g-import-not-at-top
  from model import Transformer  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  config = transformers.Qwen2Config(**{k: v for k, v in QWEN2.items() if k != "architectures"},
                                    use_sliding_window=True, sliding_window=8,
                                    layer_types=ALTERNATING, bos_token_id=None,
                                    eos_token_id=None, pad_token_id=None)
  model = transformers.Qwen2ForCausalLM(config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(1 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.15)
  model.save_pretrained(tmp_path / "hf")
  cfg, params, state = load_hf_dir(str(tmp_path / "hf"))
  assert (cfg.attention_pattern, cfg.sliding_window) == (("local", "global"), 8)
  toks = np.random.RandomState(0).randint(0, 128, (2, 24))
  with torch.no_grad():
    want = model(torch.tensor(toks)).logits.numpy()
  got = np.asarray(jax.jit(Transformer(cfg).apply)({"params": params, **state}, toks))
  assert np.abs(got - want).max() <= 1e-4
  # Without the pattern (every layer local) the logits differ: the test sees the kinds.
  local = cfg.replace(attention_pattern=())
  local_params = stack_layers(local, unstack_layers(cfg, params))  # Its own layout.
  assert np.abs(np.asarray(Transformer(local).apply({"params": local_params}, toks)) - want
                ).max() > 1e-3
  export_hf_dir((cfg, {"params": params, **state}), str(tmp_path / "out"))
  reloaded = transformers.Qwen2ForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
  assert reloaded.config.layer_types == ALTERNATING
  with torch.no_grad():
    np.testing.assert_array_equal(reloaded(torch.tensor(toks)).logits.numpy(), want)

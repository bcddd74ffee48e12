"""DeepSeek-V3 and -V2 (multi-head latent attention + their routers) against transformers:
float32 logits <= 1e-4 with and without a query latent, greedy generation through the
latent cache, exact HF -> blockwork -> HF round trips, a dense blockwork MLA model exported."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from interop import export_hf_dir, load_hf_dir  # noqa: E402
from interop.hf import read_hf_tensors  # noqa: E402
from interop import hf_config  # noqa: E402
from interop.hf_config import from_hf_config, to_hf_config  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402
from tests.interop.test_hf_parity import (TOL, assert_same_tensors, forward,  # noqa: E402
                                          greedy_tokens, hf_logits, make_hf, tokens)

ARCH = "DeepseekV3ForCausalLM"
# Distinct widths (A 16, P 4, H 8, U 12, Q 24): a swapped axis cannot fit. Layer 0 dense,
# layer 1 MoE with a shared expert.
MLA = dict(kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=12,
           num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=1,
           routed_scaling_factor=2.5)
# V3's router: sigmoid, correction bias, 1 of 2 groups. V2's: softmax, unnormalised top-k.
V3 = dict(MLA, n_group=2, topk_group=1, num_nextn_predict_layers=0)
V2 = dict(MLA, topk_method="greedy")
# Sequences of 24 > original 16: YaRN interpolates; mscale_all_dim scales the softmax.
YARN = dict(rope_type="yarn", rope_theta=1000.0, factor=4.0, original_max_position_embeddings=16,
            beta_fast=16.0, beta_slow=2.0, mscale=0.8, mscale_all_dim=0.5)
CASES = {  # id: (architecture, HF config fields, ModelConfig fields the import must set).
    "v3-q_lora-interleaved-yarn_mscale": (
        ARCH, dict(V3, q_lora_rank=24, rope_interleave=True, rope_parameters=YARN),
        dict(q_lora_rank=24, rope_layout="interleaved", rope_scaling="yarn",
             yarn_mscale_all_dim=0.5, router_score="sigmoid", load_balance="loss_free")),
    "v3-full_rank_q-split_half": (ARCH, dict(V3, q_lora_rank=None, rope_interleave=False),
                                  dict(q_lora_rank=0, rope_layout="split_half")),
    "v2-full_rank_q-yarn_mscale": (
        "DeepseekV2ForCausalLM", dict(V2, q_lora_rank=None, rope_parameters=YARN),
        dict(q_lora_rank=0, rope_layout="interleaved", router_score="softmax",
             router_norm_topk=False, route_scale=2.5, yarn_mscale_all_dim=0.5)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_deepseek_logit_parity_and_exact_round_trip(case, tmp_path):
  arch, fields, expect = CASES[case]
  model = make_hf(arch, fields)
  model.save_pretrained(tmp_path / "hf")
  cfg, params, state = load_hf_dir(str(tmp_path / "hf"))
  assert cfg.attention_type == "mla" and cfg.num_experts == 4 and cfg.first_k_dense == 1
  assert hf_config.pick_architecture(cfg) == arch
  for k, v in expect.items():
    assert getattr(cfg, k) == v, k
  toks = tokens()
  ref = hf_logits(model, toks)
  got = {"params": params, **state}
  diff = np.abs(np.asarray(forward(cfg)(got, toks)) - ref).max()
  print(f"{case}: max |logit diff| = {diff:.2e} (logits up to {np.abs(ref).max():.1f})")
  assert diff <= TOL
  if cfg.yarn_mscale_all_dim:  # The softmax mscale is really applied.
    off = cfg.replace(yarn_mscale_all_dim=0.0)
    assert np.abs(np.asarray(forward(off)(got, toks)) - ref).max() > 1e-2
  assert from_hf_config(to_hf_config(cfg)) == cfg

  export_hf_dir((cfg, got), str(tmp_path / "out"))  # pick_architecture: V2 or V3.
  assert_same_tensors(read_hf_tensors(str(tmp_path / "hf")),
                      read_hf_tensors(str(tmp_path / "out")))
  reloaded = getattr(transformers, arch).from_pretrained(str(tmp_path / "out")).eval()
  np.testing.assert_array_equal(hf_logits(reloaded, toks), ref)


def test_deepseek_v3_greedy_generation_parity(tmp_path):
  """24 greedy tokens: HF generate (its cache of expanded keys) == model/decode/loop.py through
  the latent cache with absorbed up-projections."""
  arch, fields, _ = CASES["v3-q_lora-interleaved-yarn_mscale"]
  want, got = greedy_tokens(tmp_path, arch, fields, 24)
  assert got == want
  assert min(len(set(row)) for row in got) > 6  # Not a degenerate repetition.


def test_dense_mla_model_exports_to_deepseek_v3(tmp_path):
  """A dense blockwork MLA model (the GQA ablation's MLA points) loads in transformers as
  DeepSeek-V3 with every layer dense, with the same logits."""
  cfg = ModelConfig(vocab_size=128, d_model=32, num_layers=2, num_heads=4, num_kv_heads=4,
                    mlp_dim=64, max_seq_len=64, attention_type="mla", kv_lora_rank=16,
                    rope_theta=500.0)
  shapes = jax.eval_shape(Transformer(cfg).init, jax.random.key(0), jnp.zeros((1, 4), int))
  rng = np.random.default_rng(0)
  variables = jax.tree.map(lambda s: rng.normal(0, 0.15, s.shape).astype(np.float32),
                           nn_unbox(shapes))
  export_hf_dir((cfg, variables), str(tmp_path / "out"))
  model = getattr(transformers, ARCH).from_pretrained(str(tmp_path / "out")).eval()
  toks = tokens()
  diff = np.abs(hf_logits(model, toks) - np.asarray(forward(cfg)(variables, toks))).max()
  assert diff <= TOL
  back = load_hf_dir(str(tmp_path / "out"))[0]  # Imported back: dense again, the 0 (default)
  assert back.mla_dims == cfg.mla_dims  # MLA dims now explicit.
  assert back.replace(qk_nope_head_dim=0, qk_rope_head_dim=0, v_head_dim=0) == cfg


def nn_unbox(tree):
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  return nn.unbox(tree)


def test_deepseek_v2_group_limited_router_is_refused_naming_the_field():
  hf = to_hf_config(ModelConfig(vocab_size=128, d_model=32, num_layers=2, num_heads=4,
                                num_kv_heads=4, mlp_dim=64, max_seq_len=64, num_experts=4,
                                num_shared_experts=1, router_norm_topk=False,
                                attention_type="mla", rope_layout="interleaved"))
  assert hf["architectures"] == ["DeepseekV2ForCausalLM"] and hf["topk_method"] == "greedy"
  with pytest.raises(ValueError, match="topk_method"):
    from_hf_config({**hf, "topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1})


def test_deepseek_v3_through_launch_import_then_export(tmp_path):
  """The user's path: `--mode import` writes a run that load_run reads with the HF logits;
  `--mode export` of that run writes back the same tensors."""
  from tests.cli import launch  # pylint: disable=g-import-not-at-top
  from train import load_run  # pylint: disable=g-import-not-at-top
  arch, fields, _ = CASES["v3-q_lora-interleaved-yarn_mscale"]
  model = make_hf(arch, fields)
  model.save_pretrained(tmp_path / "hf")
  run_dir, out = str(tmp_path / "run"), str(tmp_path / "out")
  assert "imported" in launch("--mode", "import", "--hf_dir", str(tmp_path / "hf"),
                              "--workdir", run_dir)
  run = load_run(run_dir)
  assert run.model_config.attention_type == "mla" and run.model_config.q_lora_rank == 24
  toks = tokens()
  diff = np.abs(np.asarray(forward(run.model_config)(run.variables, toks)) -
                hf_logits(model, toks)).max()
  assert diff <= TOL
  assert "exported" in launch("--mode", "export", "--workdir", run_dir, "--hf_dir", out)
  assert_same_tensors(read_hf_tensors(str(tmp_path / "hf")), read_hf_tensors(out))

"""experiments/probes.py: the attention logits it reads back reproduce the layer's own
attention output; activation RMS per layer; the µP coordinate check across steps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import coord_check, probes
from model import ModelConfig, Transformer
from model.transformer import stack_layers


def _cfg(**kw):
  return ModelConfig(**{**dict(vocab_size=256, d_model=32, num_layers=2, num_heads=4,
                                num_kv_heads=2, mlp_dim=64, max_seq_len=16,
                                pos_encoding="rope", scan_layers=False), **kw})


@pytest.mark.parametrize("qk_norm,softcap", [(False, 0.0), (True, 0.0), (False, 3.0)])
def test_attention_logits_reproduce_the_layers_attention_output(qk_norm, softcap):
  cfg = _cfg(qk_norm=qk_norm, attn_logit_softcap=softcap)
  tokens_BL = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 16)), jnp.int32)
  params = Transformer(cfg).init(jax.random.key(1), tokens_BL)["params"]
  params = jax.tree.map(lambda p: p * 3.0, params)  # Larger logits: a cap that bites.
  logits = probes.attention_logits(cfg, params, tokens_BL)
  _, inter = probes.capture(cfg, params, tokens_BL)
  for i, s_BNLS in enumerate(logits):
    v_BLNH = jnp.repeat(inter[f"layer_{i}/attn/v"], cfg.num_groups, axis=2)
    out_BLNH = jnp.einsum("bnls,bsnh->blnh", jax.nn.softmax(s_BNLS, axis=-1), v_BLNH)
    w_NHD = probes.nn.unbox(params)[f"layer_{i}"]["attn"]["o"]["w"]
    np.testing.assert_allclose(jnp.einsum("blnh,nhd->bld", out_BLNH, w_NHD),
                               inter[f"layer_{i}/attn"], rtol=2e-4, atol=2e-5)
    assert probes.attention_logit_max(cfg, params, tokens_BL)[i] == pytest.approx(
        float(jnp.max(s_BNLS)))
    if softcap:
      assert float(jnp.max(s_BNLS)) <= softcap
  # A scanned model's parameters give the same numbers (they are unstacked first).
  scanned = cfg.replace(scan_layers=True)
  stacked = stack_layers(scanned, probes.nn.unbox(params))
  assert probes.attention_logit_max(scanned, stacked, tokens_BL) == pytest.approx(
      probes.attention_logit_max(cfg, params, tokens_BL), rel=1e-5)


def test_activation_rms_names_every_layer():
  cfg = _cfg()
  tokens_BL = jnp.zeros((1, 8), jnp.int32)
  params = Transformer(cfg).init(jax.random.key(0), tokens_BL)["params"]
  rms = probes.activation_rms(cfg, params, tokens_BL)
  assert list(rms) == ["embed", "layer_0/attn", "layer_0/ffn", "layer_0", "layer_1/attn",
                       "layer_1/ffn", "layer_1", "logits"]
  assert rms["embed"] == pytest.approx(1.0, rel=0.2)  # Untied: unit-variance entries.


def test_coord_check_across_widths():
  result = coord_check.coord_check(widths=(32, 64), steps=2, batch=4, seq_len=16)
  growth = coord_check.growth(result, "delta")
  # 2x the width: SP's hidden activations move >= 2.5x more than µP's (measured 3.0-5.8x);
  # µP's change stays within a factor 2 at every activation the check follows.
  for k in ("layer_0/attn", "layer_0/ffn", "layer_0", "layer_1/attn", "layer_1/ffn"):
    assert growth["sp"][k] / growth["mup"][k] > 2.5, (k, growth)
  assert all(0.5 < v < 2.0 for v in growth["mup"].values()), growth["mup"]
  # At the base width µP is SP: the same losses, step for step.
  assert result["mup"]["32"]["loss"] == result["sp"]["32"]["loss"]

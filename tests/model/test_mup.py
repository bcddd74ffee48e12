"""µP's coordinate check (Tensor Programs V, section 5 / appendix D): how far 1-3 Adam
steps move the activations is flat across widths under µP and grows with width under
the standard parametrisation (SP)."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from model import ModelConfig, Transformer, mup
from train.optim import make_optimizer, mup_labels

WIDTHS = (32, 64, 128)


def _cfg(width, base):
  return ModelConfig(vocab_size=256, d_model=width, num_layers=1, num_heads=4, num_kv_heads=4,
                     mlp_dim=2 * width, max_seq_len=16, mup_base_width=base, scan_layers=False)


def _train_cfg():
  return ml_collections.ConfigDict(dict(
      lr=1e-2, warmup_steps=0, steps=3, min_lr_ratio=1.0, schedule="constant", b1=0.9,
      b2=0.95, eps=1e-8, weight_decay=0.0, decay_norms=False, decay_biases=False,
      decay_embeddings=False, grad_clip=0.0, optimizer="adamw"))


def _moves(cfg):
  """RMS change of the logits after steps 1, 2, 3 (the output is where SP's blow-up shows
  first: the readout's update grows with width)."""
  net = Transformer(cfg)
  tokens_BL = jnp.asarray(np.random.default_rng(0).integers(0, 256, (4, 17)))
  x_BL, y_BL = tokens_BL[:, :-1], tokens_BL[:, 1:]
  params = jax.tree.map(lambda a: a.value, net.init(jax.random.key(0), x_BL)["params"],
                        is_leaf=lambda a: hasattr(a, "value"))
  opt = make_optimizer(_train_cfg(), cfg)

  def loss(p):
    return optax.softmax_cross_entropy_with_integer_labels(net.apply({"params": p}, x_BL),
                                                           y_BL).mean()

  @jax.jit
  def step(p, s):  # One compile per model: the logits before the update, and the update.
    u, s = opt.update(jax.grad(loss)(p), s, p)
    return net.apply({"params": p}, x_BL), optax.apply_updates(p, u), s

  state, seen = opt.init(params), []
  for _ in range(4):  # Logits at steps 0 (init), 1, 2, 3.
    logits_BLV, params, state = step(params, state)
    seen.append(np.asarray(logits_BLV))
  return np.asarray([np.sqrt(np.mean((x - seen[0]) ** 2)) for x in seen[1:]])  # [step]


@pytest.fixture(scope="module")
def moves():
  return {(base, w): _moves(_cfg(w, base)) for base in (0, WIDTHS[0]) for w in WIDTHS}


def test_sp_moves_grow_with_width_and_mup_moves_stay_flat(moves):
  for step in range(3):
    sp = [moves[(0, w)][step] for w in WIDTHS]
    mu = [moves[(WIDTHS[0], w)][step] for w in WIDTHS]
    assert sp[0] < sp[1] < sp[2] and sp[2] / sp[0] > 2.5, (step, sp)  # ~ width: 4x
    assert max(mu) / min(mu) < 2.0, (step, mu)
  # At the base width µP is SP: the same init, scales and learning rates.
  np.testing.assert_array_equal(moves[(0, WIDTHS[0])], moves[(WIDTHS[0], WIDTHS[0])])


def test_mup_parameter_classes_and_factors():
  cfg = _cfg(128, 32)
  assert mup.width_mult(cfg) == 4 and mup.output_multiplier(cfg) == 0.25
  assert mup.softmax_scale(cfg) == pytest.approx(8 ** 0.5 / 32)  # sqrt(H_base) / H
  assert mup.hidden_init_std(cfg) == pytest.approx(0.01)
  shapes = jax.eval_shape(lambda: Transformer(cfg).init(jax.random.key(0),
                                                        jnp.zeros((1, 8), jnp.int32)))
  labels = mup_labels(jax.tree.map(lambda a: a.value, shapes["params"],
                                   is_leaf=lambda a: hasattr(a, "value")))
  assert labels["embedder"] == {"embedding": "vector", "unembed": {"w": "vector"}}
  assert labels["layer_0"]["attn"]["q"]["w"] == "hidden"
  assert labels["layer_0"]["ffn"]["wo"]["w"] == "hidden"
  assert labels["layer_0"]["norm1"]["scale"] == "vector"
  with pytest.raises(ValueError, match="mup_base_width.*tie_embeddings"):
    _cfg(64, 32).replace(tie_embeddings=True)
  from interop.hf_config import to_hf_config  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match="mup_base_width.*cannot export"):
    to_hf_config(cfg)  # Hugging Face has no field for µP's multipliers.

"""experiments/configs/pod.py's Mixtral-8x7B preset has Mixtral's shape (issue 36 item 3):
~46.7B parameters in all, ~12.9B active per token (Mistral's published figures), top-2 of
8 experts at capacity 1.25."""

import jax

from experiments.configs import pod
from model import Transformer
from train.spec import model_config


def test_mixtral_preset_has_mixtral_s_parameter_counts():
  cfg = model_config(pod.get_config("preset=mixtral,batch=3072"))
  assert (cfg.num_experts, cfg.experts_per_token, cfg.capacity_factor) == (8, 2, 1.25)
  tokens = jax.ShapeDtypeStruct((1, 8), jax.numpy.int32)
  shapes = jax.eval_shape(lambda t: Transformer(cfg).init(jax.random.key(0), t), tokens)
  total = sum(x.size for x in jax.tree.leaves(shapes["params"]))
  assert 46.0e9 < total < 47.5e9, total
  expert = sum(x.size for p, x in jax.tree_util.tree_leaves_with_path(shapes["params"])
               if any(f"['ffn']['{w}']" in jax.tree_util.keystr(p) for w in ("wi", "wg", "wo")))
  active = total - expert + expert * 2 / 8
  assert 12.5e9 < active < 13.3e9, active



def _params(preset: str) -> int:
  cfg = model_config(pod.get_config(f"preset={preset},batch=256"))
  tokens = jax.ShapeDtypeStruct((1, 8), jax.numpy.int32)
  shapes = jax.eval_shape(lambda t: Transformer(cfg).init(jax.random.key(0), t), tokens)
  return sum(x.size for x in jax.tree.leaves(shapes["params"]))


def test_anchor_presets_have_their_models_parameter_counts():
  """The pod table's MaxText anchors (issue 36 item 5): Llama 2 7B has 6.74B parameters
  (Meta's card); MaxText's global_parameter_scale=16 model, 32 layers of d 4096 with 64
  heads of 128 and mlp 28672, about 15.8B."""
  assert 6.70e9 < _params("llama2_7b") < 6.78e9
  assert 15.5e9 < _params("16b") < 16.1e9

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


def test_largest_anchor_presets_have_their_models_parameter_counts():
  """Issue 47's rows: Llama 2 70B (68.98B), Llama 3.1 405B (405.85B: Meta's 405B) and
  DeepSeek-V3 without its multi-token-prediction module (671B, DeepSeek's main-model
  count: MLA, 3 dense layers, 58 of 256 routed experts top-8 + 1 shared)."""
  assert 68.9e9 < _params("70b") < 69.1e9
  assert 405.5e9 < _params("405b") < 406.2e9
  assert 670.5e9 < _params("dsv3") < 671.5e9
  cfg = model_config(pod.get_config("preset=dsv3"))
  assert (cfg.num_experts, cfg.experts_per_token, cfg.num_shared_experts,
          cfg.first_k_dense, cfg.attention_type) == (256, 8, 1, 3, "mla")


def _table_rows() -> list[tuple[str, str, str]]:
  """docs/PERFORMANCE.md's pod table: (model, remat column, that row's command)."""
  import os  # pylint: disable=g-import-not-at-top
  import re  # pylint: disable=g-import-not-at-top
  page = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs",
                           "PERFORMANCE.md")).read()
  table = page.split("<!-- pod-table:", 1)[1].split("<!-- /pod-table -->", 1)[0]
  rows = [[c.strip() for c in line.split("|")[1:-1]] for line in table.splitlines()
          if line.startswith("| pod_")]
  commands = re.findall(r"^- `python (launch\.py [^`]+)`", table, re.M)
  assert len(rows) == len(commands) > 0
  return [(row[0], row[3], cmd) for row, cmd in zip(rows, commands)]


def test_each_pod_table_command_compiles_its_row_s_remat_without_memory_flags():
  """Issue 46 item 2: a preset is the recipe of its pod-table row: the row's command,
  as the docs print it, resolves to the remat policy (and offload map) in its row with
  no memory flag, but where the row's recipe changes the sequence length too."""
  for model, remat, cmd in _table_rows():
    arg = cmd.split("pod.py:", 1)[1].split()[0]
    c = pod.get_config(arg)
    assert model.startswith(c.name), (model, cmd)
    flags = dict(f[len("--config."):].split("=", 1) for f in cmd.split()
                 if f.startswith("--config."))
    if "model.remat" in flags:  # Only with another sequence length (MaxText's v5e recipe).
      assert "data.seq_len" in flags, cmd
      c.model.remat = flags["model.remat"]
    assert "model.remat_custom" not in flags, cmd
    policy, _, offload = remat.partition(" ")
    assert c.model.remat == policy, (cmd, c.model.remat, remat)
    assert ("offload" in c.model.remat_custom) == (offload == "(offload)"), cmd
    model_config(c)  # The preset's map is a valid one.

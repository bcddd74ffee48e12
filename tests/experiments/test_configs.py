"""The ablation configs expand to the expected points, names and valid configs."""

import pytest

from experiments import sweep
from experiments.configs import gqa_ablation, moe_ablation, rope_ablation
from model.flops import matmul_params_per_token
from train.spec import model_config, parse

CONFIGS = "experiments/configs/"


def _expand(name, arg):
  pts = sweep.points(CONFIGS + name + ".py", arg)
  configs = {p.name: sweep.point_config(CONFIGS + name + ".py", arg, p) for p in pts}
  for c in configs.values():
    parse(c, 8)  # Every point is a config the trainer accepts.
  return pts, configs


def test_gqa_points_halve_kv_heads_times_seeds():
  pts, configs = _expand("gqa_ablation", "size=small,seeds=2")
  assert [p.name for p in pts] == [f"kv{k}-s{s}" for k in (8, 4, 2, 1) for s in (0, 1)]
  assert {(c.model.num_kv_heads, c.train.seed) for c in configs.values()} == {
      (k, s) for k in (8, 4, 2, 1) for s in (0, 1)}
  # Everything else fixed: the configs differ only in the swept fields.
  flat = [{k: v for k, v in c.to_dict().items() if k not in ("model", "train")}
          for c in configs.values()]
  assert all(f == flat[0] for f in flat)
  assert gqa_ablation.kv_head_counts(6) == [6, 3, 1]
  smoke = [p.name for p in sweep.points(CONFIGS + "gqa_ablation.py", "smoke,seeds=1,task=mqar")]
  assert smoke == ["kv4-s0", "kv2-s0", "kv1-s0"]
  assert gqa_ablation.get_config("smoke,task=mqar").data.corpus == "mqar"
  with pytest.raises(ValueError, match="task="):
    gqa_ablation.get_config("task=images")


def test_rope_points_and_extrapolation_lengths():
  pts, configs = _expand("rope_ablation", "smoke,seeds=1")
  names = [p.name for p in pts]
  assert names[:7] == ["rope-s0", "rope-frac0.25-s0", "sinusoidal-s0", "learned-s0",
                       "alibi-s0", "nope-s0", "rope1-nope1-s0"]  # Smoke: 2 layers.
  assert names[7:] == [f"rope-{s}-s0" for s in rope_ablation.SCALINGS]
  encodings = {n: c.model.pos_encoding for n, c in configs.items()}
  assert encodings["nope-s0"] == "none" and encodings["rope-yarn-s0"] == "rope"
  for c in configs.values():
    assert tuple(c.eval.context_lengths) == (1, 2, 4, 8)
    # Learned positions: the table covers every evaluated position.
    assert c.model.max_seq_len >= 8 * c.data.seq_len
  # Scalings are zero-shot extension: trained as plain RoPE, applied at eval.
  yarn = configs["rope-yarn-s0"]
  assert yarn.model.rope_scaling == "none"
  assert (yarn.eval.rope_scaling, yarn.eval.rope_scaling_factor) == ("yarn", 8.0)
  from train.eval.evaluator import eval_model_config
  evaluated = eval_model_config(model_config(yarn), yarn.eval, 64)
  assert (evaluated.rope_scaling, evaluated.rope_scaling_factor) == ("yarn", 8.0)
  # The original length is the training length, whatever data.seq_len ended up as.
  assert evaluated.rope_original_max_len == 64
  assert configs["rope-frac0.25-s0"].model.rope_fraction == 0.25
  assert len(sweep.points(CONFIGS + "rope_ablation.py", "smoke,seeds=3")) == 36
  no_extension = sweep.points(CONFIGS + "rope_ablation.py", "smoke,seeds=1,lengths=1")
  assert len(no_extension) == 7  # Scalings only make sense beyond the training length.


def test_moe_points_have_equal_active_parameters():
  pts, configs = _expand("moe_ablation", "smoke,seeds=2")
  assert [p.name for p in pts] == [f"{v}-s{s}" for v in (
      "dense", "moe4x2-none", "moe4x2-aux", "moe4x2-lossfree") for s in (0, 1)]
  assert {c.model.load_balance for c in configs.values()} == {"none", "aux_loss", "loss_free"}
  dense = model_config(configs["dense-s0"])
  moe = model_config(configs["moe4x2-aux-s0"])
  assert dense.num_experts == 0 and moe.num_experts == 4
  router = moe.d_model * moe.num_experts * moe.num_layers
  assert matmul_params_per_token(moe) - router == matmul_params_per_token(dense)
  with pytest.raises(ValueError, match="topk"):
    moe_ablation.get_config("smoke,topk=3")


def test_passkey_recipe_points_and_its_mixture():
  _, configs = _expand("passkey_task", "seeds=2")
  assert sorted(configs) == sorted(
      [f"{p}-s{s}" for p in ("rope", "alibi", "nope") for s in (0, 1)] +
      [f"rope-{k}-s{s}" for k in ("linear", "ntk", "yarn") for s in (0, 1)])
  for name, c in configs.items():
    assert c.eval.tasks == "passkey" and c.data.passkey_fraction == 0.5, name
    assert c.model.max_seq_len >= 8 * c.data.seq_len  # Every retrieval length fits.
  assert configs["rope-yarn-s1"].eval.rope_scaling_factor == 8.0
  assert configs["nope-s0"].model.pos_encoding == "none"


@pytest.mark.parametrize("name, points", [("gqa_ablation", 9), ("rope_ablation", 36),
                                          ("moe_ablation", 12)])
def test_the_cpu_preset_of_each_text_ablation(name, points):
  """docs/ablations.md, "On a CPU": the measured preset, every point a valid config."""
  pts, configs = _expand(name, "cpu")
  assert len(pts) == points
  for c in configs.values():
    assert (c.model.d_model, c.model.num_layers, c.data.seq_len, c.data.batch_size,
            c.train.steps) == (64, 2, 64, 16, 800)
    assert c.data.corpus == "shakespeare"  # A text ablation.
  for bad in ("cpu,smoke", "cpu,size=small"):
    with pytest.raises(ValueError, match="config argument cpu: a preset of its own"):
      sweep.points(CONFIGS + name + ".py", bad)

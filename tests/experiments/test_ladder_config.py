"""The ladder's budgets follow their rule; the µP transfer sweep's points are valid."""

import math

import pytest

from experiments import sweep
from model.flops import matmul_params_per_token, training_flops_per_token
from train.spec import model_config, parse

LADDER = "experiments/configs/ladder.py"


def _configs(path, arg):
  pts = sweep.points(path, arg)
  out = {p.name: (p, sweep.point_config(path, arg, p)) for p in pts}
  for _, c in out.values():
    parse(c, 8)
  return out


def test_tokens_per_parameter_budgets_with_decay_branches():
  pts = _configs(LADDER, "sizes=xs+s,variants=mha+mqa,seeds=1,tpp=2,budgets=0.5,min_steps=1")
  trunk, c = pts["s-mha-s0"]
  step_tokens = c.data.batch_size * c.data.seq_len
  full = math.ceil(2 * matmul_params_per_token(model_config(c)) / step_tokens)
  assert c.train.steps == full and c.train.schedule == "wsd"
  branch, b = pts[f"s-mha-t{round(full / 2)}-s0"]
  assert branch.branch_of == "s-mha-s0" and b.train.steps == round(full / 2)
  assert b.model.d_model == c.model.d_model  # The source's model, a shorter budget.
  assert pts["s-mqa-s0"][1].train.steps == full  # Every variant: the baseline's tokens.
  assert pts["s-mqa-s0"][1].model.num_kv_heads == 1


def test_isoflop_budgets():
  arg = "sizes=xs+s,variants=mha,seeds=1,flops=1e11+4e11,min_steps=1"
  pts = _configs(LADDER, arg)
  for size in ("xs", "s"):
    _, c = pts[f"{size}-mha-s0"]
    per_step = training_flops_per_token(model_config(c), c.data.seq_len) * (
        c.data.batch_size * c.data.seq_len)
    assert c.train.steps == round(4e11 / per_step)
    assert f"{size}-mha-t{round(1e11 / per_step)}-s0" in pts
  with pytest.raises(ValueError, match="sizes"):
    sweep.points(LADDER, "sizes=huge")


def test_mup_transfer_points():
  pts = _configs("experiments/configs/mup_transfer.py", "widths=64+128,lrs=1e-3+1e-2")
  assert len(pts) == 16  # 2 seeds by default, all of seed 0's points first.
  assert [n[-2:] for n in pts] == ["s0"] * 8 + ["s1"] * 8
  mu = model_config(pts["mup-w128-lr0.01-s0"][1])
  assert (mu.d_model, mu.mup_base_width) == (128, 64)
  assert model_config(pts["sp-w128-lr0.01-s0"][1]).mup_base_width == 0

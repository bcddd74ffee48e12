"""Config arguments (`config.py:a=1,b`) are declared: typos and bad values are errors."""

import glob
import os

import pytest

from experiments import sweep
from experiments.configs import base, gqa_ablation, moe_ablation, tiny
from tests.cli import ROOT, launch


def test_parse_arg_types_and_bare_words():
  a = base.parse_arg("seeds=2, lr=1e-3,name=x,smoke", seeds=3, lr=0.1, name="", smoke=False)
  assert (a.seeds, a.lr, a.name, a.smoke) == (2, 1e-3, "x", True)
  assert base.parse_arg("smoke=no", smoke=True).smoke is False
  assert base.parse_arg(None, seeds=3).seeds == 3


@pytest.mark.parametrize("arg, match", [
    ("seed=2", r"'seed'.*seeds, size, smoke, steps, task, uptrain"),  # Misspelt: lists the known.
    ("smoke=flase", r"smoke='flase': expected a boolean"),
    ("seeds=two", r"seeds='two': expected int"),
    ("uptrain=half", r"uptrain='half': expected float"),
    ("seeds", r"'seeds' needs a value"),
    ("seeds=1,seeds=2", r"'seeds' is given twice"),
])
def test_derived_config_rejects_bad_arguments(arg, match):
  with pytest.raises(ValueError, match=match):
    gqa_ablation.get_config(arg)


def test_base_and_tiny_reject_derived_keys():
  with pytest.raises(ValueError, match=r"'seeds'.*size, smoke"):
    base.get_config("seeds=2")
  with pytest.raises(ValueError, match=r"'sise'"):
    tiny.get_config("sise=small")
  assert tiny.get_config("size=small,smoke").model.num_layers == 2  # base's keys pass through.


def test_every_config_accepts_its_declared_arguments():
  """Each config's own keys reach base.get_config without being rejected there."""
  assert gqa_ablation.get_config("smoke,seeds=1,steps=5,uptrain=0.5").train.steps == 5
  assert moe_ablation.get_config("smoke,experts=4,topk=1,ep=1").model.num_experts == 4
  for path in glob.glob(os.path.join(ROOT, "experiments", "configs", "*.py")):
    module = sweep.load_module(path)
    if not hasattr(module, "get_config") or path.endswith("from_run.py"):
      continue
    module.get_config("smoke,size=tiny")
    with pytest.raises(ValueError, match="not one of this config's arguments"):
      module.get_config("smoke,no_such_key=1")
    if hasattr(module, "sweep"):
      assert module.sweep("smoke,seeds=1")


def test_launch_reads_the_config_arg_from_config_flags(tmp_path):
  """--sweep_emit gets the `:arg` from config_flags in both spellings of --config."""
  config = os.path.join(ROOT, "experiments", "configs", "gqa_ablation.py")
  for spelling in (["--config", f"{config}:smoke,seeds=1"], [f"--config={config}:smoke,seeds=1"]):
    out = launch(*spelling, "--workdir", str(tmp_path), "--sweep_emit", "commands")
    assert out.count("launch.py") == 3 and "kv1-s0" in out and "-s1" not in out
  with pytest.raises(Exception, match="config argument 'seed'"):  # absl wraps it.
    launch("--config", f"{config}:smoke,seed=2", "--workdir", str(tmp_path), "--sweep")

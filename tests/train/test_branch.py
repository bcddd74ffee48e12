"""WSD schedules and decay branches: the schedule's shape, and a branch from a longer
run's stable phase == the same schedule trained in one run, bitwise (through --sweep)."""

import json
import re

import jax
import ml_collections
import numpy as np
import pytest

from tests.cli import launch
from train import load_run
from train.metrics import read_metrics
from train.optim import decay_start, learning_rate_schedule

CONFIG = '''
from experiments.configs import tiny

def get_config(arg=None):
  c = tiny.get_config("smoke")
  c.train.update(schedule="wsd", decay_fraction=0.25, steps=20, warmup_steps=2, log_every=1,
                 async_checkpoint=False, tensorboard=False)
  return c

def sweep(arg=None):
  return [{"name": "trunk"}, {"name": "b16", "branch_of": "trunk", "train.steps": 16},
          {"name": "one16", "train.steps": 16}]
'''


def _train_cfg(**kw):
  return ml_collections.ConfigDict({**dict(lr=1.0, warmup_steps=10, steps=100, min_lr_ratio=0.1,
                                           schedule="wsd", decay_fraction=0.2), **kw})


@pytest.mark.parametrize("shape", ["linear", "sqrt"])
def test_wsd_schedule_shape(shape):
  cfg = _train_cfg(decay_shape=shape)
  lr = learning_rate_schedule(cfg)
  assert decay_start(cfg) == 80
  assert float(lr(5)) == pytest.approx(0.5)  # Linear warmup.
  assert [float(lr(t)) for t in (10, 50, 80)] == [1.0, 1.0, 1.0]  # Stable: exactly lr.
  frac = {"linear": 0.5, "sqrt": 0.5 ** 0.5}[shape]  # Half-way through the cooldown.
  assert float(lr(90)) == pytest.approx(1.0 - 0.9 * frac)
  assert float(lr(100)) == pytest.approx(0.1)
  longer = learning_rate_schedule(_train_cfg(decay_shape=shape, steps=400))
  # A longer run's schedule is this one's, exactly, until this one's cooldown starts.
  assert all(float(longer(t)) == float(lr(t)) for t in range(0, 81))


@pytest.fixture(scope="module")
def branched(tmp_path_factory):
  root = tmp_path_factory.mktemp("wsd")
  config = root / "wsd_sweep.py"
  config.write_text(CONFIG)
  out = launch("--config", str(config), "--workdir", str(root / "runs"), "--sweep")
  return root / "runs", out


def test_a_branch_equals_the_same_schedule_in_one_run_bitwise(branched):
  runs, out = branched
  assert re.search(r"^b16 +done$", out, re.M)
  record = json.loads((runs / "b16" / "config.json").read_text())
  assert record["_run"]["branched_from"] == str(runs / "trunk")
  assert record["_run"]["source_step"] == 12  # 16 - 0.25 * 16: only the cooldown trains.
  assert 12 in json.loads((runs / "trunk" / "config.json").read_text())["train"]["keep_steps"]
  assert not (runs / "b16" / "config_changes.jsonl").exists()  # config.json as trained.
  lines = lambda name: {r["step"]: r for r in read_metrics(str(runs / name))
                        if r["split"] == "train"}
  branch, one = lines("b16"), lines("one16")
  trained = sorted(branch)
  assert trained == [13, 14, 15, 16]
  for step in trained:
    for key in ("loss", "grad_norm", "param_norm", "lr", "tokens_seen"):
      assert branch[step][key] == one[step][key], (step, key)  # tokens counted from 0.
  evals = lambda name: [r for r in read_metrics(str(runs / name)) if r["split"] == "eval"]
  assert evals("b16")[-1]["loss"] == evals("one16")[-1]["loss"]
  a, b = (jax.tree.leaves(load_run(str(runs / n)).variables["params"]) for n in ("b16", "one16"))
  assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_rerunning_skips_finished_branches(branched):
  runs, _ = branched
  before = (runs / "b16" / "metrics.jsonl").read_text()
  out = launch("--config", str(runs.parent / "wsd_sweep.py"), "--workdir", str(runs), "--sweep")
  assert re.search(r"^b16 +skipped$", out, re.M) and re.search(r"^trunk +skipped$", out, re.M)
  assert (runs / "b16" / "metrics.jsonl").read_text() == before

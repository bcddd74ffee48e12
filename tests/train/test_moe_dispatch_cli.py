"""Through launch.py: the MoE dispatch strategy that ran is recorded in config.json's
`_run.moe_dispatch`, a run configured with the old name "capacity" resumes under the new
default "auto", and the recorded strategy, named explicitly, trains the same numbers."""

import json

import pytest

from tests.cli import launch

MOE = ("--config.model.num_experts=4", "--config.model.experts_per_token=2",
       "--config.model.expert_mlp_dim=32", "--config.train.log_every=1",
       "--config.train.eval_every=100")
# 8 simulated devices (tests/conftest.py): "auto" runs the one-hot einsums, which shard.
ON_A_MESH = {"train": "capacity_einsum", "eval": "capacity_einsum"}


def losses(workdir) -> list[float]:
  rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  return [r["loss"] for r in rows if r["split"] == "train"]


@pytest.fixture(scope="module")
def old_name_run(tmp_path_factory):
  """Two steps with moe_dispatch="capacity", the name "auto" had before issue 26."""
  workdir = tmp_path_factory.mktemp("moe_capacity")
  launch("--workdir", str(workdir), *MOE, "--config.train.steps=2",
         "--config.model.moe_dispatch=capacity")
  return workdir


def test_the_strategy_that_ran_is_recorded(old_name_run):
  record = json.load(open(old_name_run / "config.json"))
  assert record["_run"]["moe_dispatch"] == ON_A_MESH
  assert record["model"]["moe_dispatch"] == "capacity"  # What the user wrote, kept.


def test_the_recorded_strategy_named_explicitly_trains_the_same(old_name_run, tmp_path):
  launch("--workdir", str(tmp_path), *MOE, "--config.train.steps=2",
         f"--config.model.moe_dispatch={ON_A_MESH['train']}")
  assert losses(tmp_path) == losses(old_name_run)


def test_a_run_with_the_old_name_resumes_under_the_new_default(old_name_run):
  out = launch("--workdir", str(old_name_run), *MOE, "--config.train.steps=3")
  assert len(losses(old_name_run)) == 3, out
  changes = old_name_run / "config_changes.jsonl"
  changed = [json.loads(line)["field"] for line in open(changes)] if changes.exists() else []
  assert "model.moe_dispatch" not in changed

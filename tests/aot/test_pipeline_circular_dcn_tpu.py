"""The circular schedule (train.pipeline_repeats=2) compiled for two TPU slices with the
stages across them: only activations cross the data-centre network (the ring's permutes,
R M + S - 1 ticks each way, and the stage axis' activation-sized sums), never a weight
all-gather or a gradient reduce-scatter: the trainer's pipeline row order
(train/state.py PipelineOrder) puts each stage's chunks on it, so no weight moves per step
(docs/scaling.md, "The circular schedule (`train.pipeline_repeats`)")."""

import json

import pytest

from tests.aot.test_pipeline_dcn_tpu import COMMON
from tests.cli import launch
from train.aot import libtpu_available

pytestmark = [pytest.mark.aot, pytest.mark.skipif(
    not libtpu_available(), reason="libtpu is not installed: make test-aot")]


def test_circular_stages_across_slices_send_only_activations_over_the_dcn(tmp_path):
  path = tmp_path / "r2.json"
  printed = launch(*COMMON, "--config.mesh.dcn_stage=2", "--config.train.pipeline_repeats=2",
                   "--out", str(path))
  dcn = json.loads(path.read_text())["steps"]["train"]["dcn_collectives"]
  assert set(dcn) <= {"collective-permute", "all-reduce", "all-gather", "total"}, dcn
  # M = S = 2, R = 2: the tick loop's ring permute (forward, and its transpose) runs
  # R M + S - 1 = 5 times each, plus the last stage's output and its gradient, plus the
  # input's gather to stage 0 and the output's scatter (test_pipeline_dcn_tpu.py).
  assert dcn["collective-permute"]["count"] == 2 * 5 + 2 + 2
  assert dcn["all-reduce"]["count"] <= 8  # With the head's and embedding's gradients.
  assert dcn.get("all-gather", {"bytes": 0})["bytes"] < 128 * 128 * 2  # Rows, no weight.
  assert "across slices (DCN): 14 collective-permute" in printed

"""Issue 47 item 4: `--mode compile` on two slices shows what crosses the data-centre
network (DCN) per collective kind: with the pipeline's stages across the slices
(`mesh.dcn_stage=2`, fsdp inside each), the stage transfers (collective permutes), a few
all-reduces (the input's gradient, and the head's and embedding's weight gradients: they
run on each stage's share of the rows) and row-sized gathers, never a weight all-gather
or a reduce-scatter;
with fsdp or data across the slices, the weights' all-gathers and the gradients'
all-reduces (train/aot/hlo.py dcn_collectives; docs/scaling.md, "Pipeline parallelism").
"""

import json

import pytest

from tests.cli import launch
from train.aot import libtpu_available

pytestmark = [pytest.mark.aot, pytest.mark.skipif(
    not libtpu_available(), reason="libtpu is not installed: make test-aot")]

# Tiny: 4 layers, d_model 128, 1.0M parameters, batch 16 x 128 tokens, on 2 x v5e:2x2.
# attention_impl=xla: one kernel for the three meshes, so their counts compare ("auto" is
# Splash without stages and XLA's inside them).
COMMON = ("--mode", "compile", "--config", "experiments/configs/tiny.py", "--topology",
          "v5e:2x2", "--num_slices", "2", "--config.mesh.data=1", "--config.mesh.fsdp=4",
          "--config.train.telemetry=False", "--config.model.attention_impl=xla",
          "--compile_steps", "train", "--noroofline")
ACROSS = {"stage": "--config.mesh.dcn_stage=2", "fsdp": "--config.mesh.dcn_fsdp=2",
          "data": "--config.mesh.dcn_data=2"}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
  out = {}
  for axis, flag in ACROSS.items():
    path = tmp_path_factory.mktemp("dcn") / f"{axis}.json"
    printed = launch(*COMMON, flag, "--out", str(path))
    out[axis] = printed, json.loads(path.read_text())
  return out


def _dcn(r):
  return r["steps"]["train"]["dcn_collectives"]


def test_stages_across_slices_send_only_activations_over_the_dcn(reports):
  printed, r = reports["stage"]
  assert r["mesh"]["stage"] == 2 and r["mesh"]["fsdp"] == 4
  dcn = _dcn(r)
  assert set(dcn) <= {"collective-permute", "all-reduce", "all-gather", "total"}, dcn
  # M = S = 2 microbatches: the tick loop's permute (forward, and its transpose) runs
  # M + S - 1 = 3 times each, plus the last stage's output and its gradient, plus the
  # input gathered to stage 0 and the output scattered over the stages (the head runs
  # split over them: parallel/pipeline.py stage_map), each with its gradient's.
  assert dcn["collective-permute"]["count"] == 2 * 3 + 2 + 2
  # Summed over the stages: the input's gradient and, as the head and embedding run on
  # each stage's share of the rows, their weights' gradients (measured: 7, 68.6 KB). A
  # handful, not one per weight; far fewer bytes than data-across-slices reduces.
  assert dcn["all-reduce"]["count"] <= 8
  assert dcn["all-reduce"]["bytes"] < _dcn(reports["data"][1])["all-reduce"]["bytes"] / 4
  # Any gather over the stages is row-sized (measured: 2, 2 KB), never a weight's: the
  # smallest weight matrix is 128 x 128 bf16, 32 KB.
  assert dcn.get("all-gather", {"bytes": 0})["bytes"] < 128 * 128 * 2
  assert "across slices (DCN): 10 collective-permute" in printed
  # The fsdp gathers stay on the chips' interconnect, inside each slice.
  assert r["steps"]["train"]["collectives"]["all-gather"]["count"] > 0


def test_fsdp_or_data_across_slices_sends_weights_and_gradients_over_the_dcn(reports):
  fsdp, data = _dcn(reports["fsdp"][1]), _dcn(reports["data"][1])
  params = reports["data"][1]["params"]
  assert "collective-permute" not in fsdp and "collective-permute" not in data
  # fsdp across slices gathers every layer's weights over the DCN ...
  assert fsdp["all-gather"]["count"] > 0 and fsdp["all-gather"]["bytes"] >= params / 4
  # ... and both reduce the gradients (each chip's float32 shard of them) over it.
  for dcn in (fsdp, data):
    assert dcn["all-reduce"]["bytes"] >= 4 * params / 8


def test_auto_attention_compiles_inside_stages_and_splash_is_refused_by_name(tmp_path):
  """"auto" picks Splash on TPU, except inside pipeline stages, where Splash's own
  shard_map does not nest (model/attention/impls.py): there it runs XLA's / blockwise, and
  an explicit splash is refused with the reason instead of XLA's cotangent-type error."""
  one_slice = ("--mode", "compile", "--config", "experiments/configs/tiny.py", "--topology",
               "v5e:2x2", "--config.mesh.stage=2", "--config.mesh.data=1",
               "--config.mesh.fsdp=2", "--config.train.telemetry=False",
               "--compile_steps", "train", "--noroofline")
  path = tmp_path / "auto.json"
  launch(*one_slice, "--out", str(path))
  assert json.loads(path.read_text())["attention_impl"]["train"] in ("xla", "blockwise")
  with pytest.raises(ValueError, match="cannot run inside pipeline stages"):
    launch(*one_slice, "--config.model.attention_impl=splash", "--out", str(tmp_path / "s.json"))

"""Issue 47 item 6: `launch.py --mode compile --fit` on two slices reports pipeline-across-
slices against fsdp-across-slices (each an ESTIMATE with v5e's DCN bandwidth) and
recommends the faster, in what it prints and in its JSON; the search ranks its policies
on the corrected estimate (train/aot/estimate.py). Tiny: 4 layers, 1.0M parameters,
2 x v5e:2x2, 2 sequences of 128 per chip.
"""

import json

import pytest

from tests.cli import launch
from train.aot import libtpu_available

pytestmark = [pytest.mark.aot, pytest.mark.skipif(
    not libtpu_available(), reason="libtpu is not installed: make test-aot")]

FIT = ("--mode", "compile", "--fit", "--fit_policies=full", "--fit_max_per_chip=2",
       "--config", "experiments/configs/tiny.py", "--topology", "v5e:2x2",
       "--num_slices", "2", "--config.mesh.data=1", "--config.mesh.fsdp=4",
       "--config.mesh.dcn_fsdp=2", "--config.train.telemetry=False",
       "--config.model.attention_impl=xla")


def test_fit_on_two_slices_compares_pipeline_and_fsdp_across_them(tmp_path):
  out = tmp_path / "fit.json"
  printed = launch(*FIT, "--out", str(out))
  r = json.loads(out.read_text())
  row = r["policies"][0]
  assert row["remat"] == "full" and row["per_chip"] == 2
  # The search ranks on the corrected estimate, not the three-term roofline.
  assert row["step_time_s"] == row["estimate"]["step_time_s"] >= row["roofline_step_time_s"]
  a = r["across_slices"]
  fsdp, pipe = a["fsdp"], a["pipeline"]
  assert fsdp["mesh"] == "dcn_fsdp=2" and pipe["mesh"] == "dcn_stage=2"
  assert fsdp["fits"] and pipe["fits"]
  # Only activations cross between stages; fsdp gathers weights and reduces gradients.
  assert 0 < pipe["dcn_bytes"] < fsdp["dcn_bytes"]
  assert pipe["stages"] == 2 and pipe["microbatches"] == 2
  assert pipe["estimate"]["compute_s"] == pytest.approx(1.5 * fsdp["estimate"]["compute_s"])
  times = {n: a[n]["estimate"]["step_time_s"] for n in ("fsdp", "pipeline")}
  assert a["recommended"] == min(times, key=times.get)
  # The searched mesh is fsdp across slices: the pipeline's flags undo it.
  assert a["flags"] == {"fsdp": "", "pipeline": "--config.mesh.dcn_fsdp=1 "
                        "--config.mesh.dcn_stage=2"}[a["recommended"]]
  assert r["recommended"]["flags"].endswith(a["flags"])
  assert "across 2 slices at remat=full, 2 per chip (DCN 3.12 GB/s per chip):" in printed
  assert (f"across slices: {a['flags'] or 'the searched mesh'} ({a['recommended']} across "
          "slices: ") in printed
  assert "(ESTIMATE)" in printed

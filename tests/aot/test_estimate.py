"""The step-time ESTIMATE's added terms (train/aot/estimate.py) and `--fit`'s comparison
across slices (train/aot/fit_slices.py), on hand-made reports: CPU, no libtpu.

Properties: host-offload traffic is the host buffers out and back over the chip's host
link, and on the 8b row's figures (28 GiB per chip on v6e) it, not compute, bounds the
step; the loss's head re-reads grow with chunks - 1 and shrink with the tensor axis; the
step time is the max of the terms, the serial time their sum; the pipeline's compute
grows by GPipe's (M + S - 1) / M; the comparison picks the layout with the shorter
estimate, through `across_slices` with the search's own batch/policy setter.
"""

import copy

import pytest

from benchmarks import pod_table
from experiments.configs import tiny
from train.aot import estimate, fit, fit_slices
from train.aot.fit_ledger import Ledger
from train.aot.hlo import host_transfers
from train.aot.topology import GiB, LINKS, parse_topology

V6E = parse_topology("v6e-256")


def _step(host=0, dcn=0.0, permute=0.0, chunks=1, batch=1024, length=8192):
  """A compiled train step's report as mode.py writes it, roofline included."""
  roof = {"compute_s": 2.0, "hbm_s": 1.0, "collective_s": 0.5}
  return {"shapes": {"batch": batch, "length": length}, "roofline": roof,
          "cost": {"flops": 1.8 * V6E.chip.peak_flops, "kernel_flops": 0.0, "bytes_accessed": 1.0,
                   "loss_chunks": chunks},
          "memory": {"total": GiB, "host_temporaries": host},
          "collectives": {"collective-permute": {"wire_bytes": permute},
                          "total": {"wire_bytes": 0.5 * V6E.chip.ici_bandwidth}},
          "dcn_collectives": {"collective-permute": {"bytes": permute},
                              "total": {"bytes": dcn}},
          "model_flops_per_chip": 1.5 * V6E.chip.peak_flops, "fits": True}


class _Cfg:  # The fields the estimate reads of a ModelConfig.
  vocab_size, d_model, dtype, param_dtype = 128256, 4096, "bfloat16", "float32"


def test_host_offload_bounds_the_8b_row_and_the_step_is_the_max_of_its_terms():
  step = _step(host=28 * GiB)
  estimate.add_estimate(step, _Cfg, {"fsdp": 256}, V6E)
  est = step["estimate"]
  host_s = 2 * 28 * GiB / LINKS["v6e"].host
  assert est["host_s"] == pytest.approx(host_s) and est["bound"] == "host"
  assert est["step_time_s"] == pytest.approx(host_s)  # ~4 s against 2 s of compute.
  assert est["step_time_serial_s"] == pytest.approx(2.0 + 1.0 + 0.5 + host_s)
  assert est["tokens_per_s"] == pytest.approx(1024 * 8192 / host_s)
  assert est["mfu"] == pytest.approx(1.5 / host_s)
  none = _step()
  estimate.add_estimate(none, _Cfg, {"fsdp": 256}, V6E)
  assert none["estimate"]["bound"] == "compute" and none["estimate"]["host_s"] == 0


def test_head_rereads_grow_with_chunks_and_shrink_with_the_tensor_axis():
  one = estimate.head_reread_bytes(1000, 64, "bfloat16", "float32", 1)
  four = estimate.head_reread_bytes(1000, 64, "bfloat16", "float32", 4)
  split = estimate.head_reread_bytes(1000, 64, "bfloat16", "float32", 4, tensor=2)
  # Per chunk: three bf16 reads of the head, its float32 gradient read and written.
  assert one == 0 and four == 3 * 1000 * 64 * (3 * 2 + 2 * 4) and split == four / 2
  with pytest.raises(ValueError, match="chunks=0"):
    estimate.head_reread_bytes(1000, 64, "bfloat16", "float32", 0)
  step = _step(chunks=8)
  estimate.add_estimate(step, _Cfg, {"tensor": 1}, V6E)
  reread = 7 * 128256 * 4096 * (3 * 2 + 2 * 4)
  assert step["estimate"]["bytes"]["head_rereads"] == reread
  assert step["estimate"]["hbm_s"] == pytest.approx(1.0 + reread / V6E.chip.hbm_bandwidth)


def test_stage_transfers_count_on_ici_with_a_stage_axis_and_on_the_dcn_across_slices():
  step = _step(dcn=3e9, permute=1e9)
  assert estimate.stage_transfers(step, {"stage": 2}) == {"ici": 1e9, "dcn": 1e9}
  assert estimate.stage_transfers(step, {"stage": 1})["ici"] == 0
  estimate.add_estimate(step, _Cfg, {"stage": 2}, V6E)
  assert step["estimate"]["dcn_s"] == pytest.approx(3e9 / LINKS["v6e"].dcn)


# An offloading policy's copies as XLA:TPU writes them (host memory is S(5)): a scanned
# layer (4 trips) storing into a host buffer and, after it, one copy back.
HLO = """HloModule jit_train_step

%cond (p: (s32[])) -> pred[] {
  %c = s32[] constant(4)
  ROOT %lt = pred[] compare(%p, %c), direction=LT
}

%body (p: (s32[])) -> (s32[]) {
  %dus = ((bf16[4,8,128]{2,1,0:T(8,128)S(5)}, bf16[1,8,128]{2,1,0:T(8,128)}, s32[]), bf16[4,8,128]{2,1,0:T(8,128)S(5)}, u32[]{:S(2)}) dynamic-update-slice-start(%a, %b, %i)
}

ENTRY %main (a: f32[8]) -> f32[] {
  %while.1 = (s32[]) while(%init), condition=%cond, body=%body
  %copy-start.1 = (bf16[8,128]{1,0:T(8,128)}, bf16[8,128]{1,0:T(8,128)S(5)}, u32[]{:S(2)}) copy-start(%x)
  %copy-start.2 = (bf16[2,128]{1,0:T(8,128)S(5)}, bf16[2,128]{1,0:T(8,128)}, u32[]{:S(2)}) copy-start(%y)
}
"""


def test_host_transfers_counts_each_copy_per_trip_and_its_direction():
  out = host_transfers(HLO)
  assert out == {"to_host": 4 * 8 * 128 * 2 + 2 * 128 * 2, "from_host": 8 * 128 * 2,
                 "count": 6}
  assert host_transfers(HLO.replace("S(5)", "S(1)"))["count"] == 0


def test_the_pipeline_pays_its_bubble_and_the_shorter_layout_is_recommended():
  assert fit_slices.bubble_factor(2, 2) == 1.5 and fit_slices.bubble_factor(4, 12) == 15 / 12
  topo = parse_topology("v5e:2x2", 2)
  config = tiny.get_config("")
  config.mesh.update(data=1, fsdp=4, dcn_fsdp=2)
  seen = []

  def compile_train(cfg, topo, roofline):
    layout = "pipeline" if cfg.mesh.dcn_stage == 2 else "fsdp"
    seen.append((layout, cfg.model.remat, cfg.data.batch_size, roofline))
    step = _step(dcn=2e10 if layout == "fsdp" else 1e8, batch=cfg.data.batch_size,
                 length=128)
    step["memory"]["total"] = GiB
    if roofline:
      estimate.add_estimate(step, _Cfg, {"fsdp": 8}, topo)
    return step

  rec = {"remat": "full", "per_chip": 2}
  ledger = Ledger.open(None, "k")
  out = fit_slices.across_slices(config, topo, rec, compile_train, fit._with, ledger)
  # The search's own mesh is fsdp across slices, but rec carries no estimate: both compile,
  # at the recommended policy and batch (2 per chip x 8 chips), the roofline for fsdp only.
  assert sorted(seen) == [("fsdp", "full", 16, True), ("pipeline", "full", 16, False)]
  fsdp_s = out["fsdp"]["estimate"]["step_time_s"]
  assert out["fsdp"]["estimate"]["bound"] == "dcn"  # 20 GB over 3.1 GB/s per chip.
  pipe = out["pipeline"]["estimate"]
  assert pipe["compute_s"] == pytest.approx(2.0 * 1.5)  # S = M = 2: 3 ticks for 2.
  assert out["pipeline"]["bubble"] == pytest.approx(1 / 3)
  assert pipe["step_time_s"] < fsdp_s and out["recommended"] == "pipeline"
  # tiny logs telemetry, which stages do not carry: the pipeline's flags turn it off.
  assert out["flags"] == ("--config.mesh.dcn_fsdp=1 --config.mesh.dcn_stage=2 "
                          "--config.train.telemetry=False")
  lines = fit_slices.slices_lines({"num_slices": 2, "across_slices": out})
  assert lines[-1].startswith("across slices: --config.mesh.dcn_fsdp=1 "
                              "--config.mesh.dcn_stage=2 --config.train.telemetry=False "
                              "(pipeline")
  again = fit_slices.across_slices(config, topo, rec, compile_train, fit._with, ledger)
  assert len(seen) == 2 and again["recommended"] == "pipeline"  # The ledger's compiles.
  assert config.mesh.dcn_fsdp == 2 and config.mesh.dcn_stage == 1  # Input untouched.


def test_a_fast_dcn_keeps_fsdp_and_a_refused_layout_is_said():
  topo = parse_topology("v5e:2x2", 2)
  config = tiny.get_config("")
  config.mesh.update(data=1, fsdp=4, dcn_fsdp=2)

  def compile_train(cfg, topo, roofline):
    if cfg.mesh.dcn_stage == 2:
      raise ValueError("a stacked parameter of 3 layers cannot be cut into 2 stages")
    step = _step(dcn=1e6, batch=cfg.data.batch_size, length=128)
    estimate.add_estimate(step, _Cfg, {"fsdp": 8}, topo)
    return step

  out = fit_slices.across_slices(config, topo, {"remat": "full", "per_chip": 1},
                                 compile_train, fit._with, Ledger.open(None, "k"))
  assert out["recommended"] == "fsdp" and out["why"] == "only fsdp fits"
  assert out["flags"] == ""  # The searched mesh is fsdp across slices.
  assert "cannot be cut" in out["pipeline"]["refused"]


def test_the_pipeline_runs_without_telemetry_and_a_compiler_failure_is_said():
  """The 405b case: the preset logs per-layer telemetry (refused on stages), and libtpu
  fails on its pipeline. The pipeline layout is compiled with telemetry off, and its
  compile failure is reported, not raised: fsdp is still compared and recommended."""
  import jax  # pylint: disable=g-import-not-at-top
  topo = parse_topology("v5e:2x2", 2)
  config = tiny.get_config("")
  config.mesh.update(data=1, fsdp=4, dcn_fsdp=2)
  config.train.telemetry = True
  telemetry = {}

  def compile_train(cfg, topo, roofline):
    layout = "pipeline" if cfg.mesh.dcn_stage == 2 else "fsdp"
    telemetry[layout] = cfg.train.telemetry
    if layout == "pipeline":
      raise jax.errors.JaxRuntimeError("INTERNAL: during context [post-optimization]: "
                                       "The async-start expects ...\n(the rest)")
    step = _step(dcn=1e6, batch=cfg.data.batch_size, length=128)
    estimate.add_estimate(step, _Cfg, {"fsdp": 8}, topo)
    return step

  out = fit_slices.across_slices(config, topo, {"remat": "full", "per_chip": 1},
                                 compile_train, fit._with, Ledger.open(None, "k"))
  assert telemetry == {"fsdp": True, "pipeline": False}
  assert out["pipeline"]["failed"] == ("INTERNAL: during context [post-optimization]: "
                                       "The async-start expects ...")
  assert out["recommended"] == "fsdp" and out["why"] == "only fsdp fits"
  lines = fit_slices.slices_lines({"num_slices": 2, "across_slices": out})
  assert any(l.startswith("  pipeline (dcn_stage=2): failed to compile: INTERNAL") for l in lines)
  assert fit_slices._mesh_flags(config, topo, "pipeline") == (  # pylint: disable=protected-access
      "--config.mesh.dcn_fsdp=1 --config.mesh.dcn_stage=2 --config.train.telemetry=False")
  assert config.train.telemetry is True  # Input untouched.


def test_pod_table_cells_show_the_estimate_and_its_ratio_to_maxtext():
  step = _step(host=28 * GiB, batch=1024)
  estimate.add_estimate(step, _Cfg, {"fsdp": 256}, V6E)
  step.update(tokens_per_s_estimate=1024 * 8192 / 2.0, mfu_estimate=0.75)
  r = {"chips": 256, "maxtext": "7,207 tokens/s/chip, 45.46% MFU"}
  cells = pod_table._speed_cells(step, r)  # pylint: disable=protected-access
  tokens = 1024 * 8192 / (2 * 28 * GiB / LINKS["v6e"].host) / 256
  assert cells.startswith(f"{tokens:,.0f} (roofline alone: 16,384); "
                          f"{tokens / 7207:.2f}x MaxText's | ")
  assert "(host-bound; " in cells and "x MaxText's)" in cells
  assert pod_table.maxtext_figures("61% MFU") == {"mfu": 0.61}
  assert "MaxText" not in pod_table._speed_cells(copy.deepcopy(step), {"chips": 256})


@pytest.mark.parametrize("stages,micro", [(2, 0), (2, 4), (4, 16)])
def test_a_pipelined_step_pays_its_bubble_on_compute_and_hbm(stages, micro):
  """The probes' per-chip cost (compiled with the stages folded into fsdp) times GPipe's
  (M + S - 1) / M; the stage transfers stay the step's own collectives."""
  step = _step(permute=3e9)
  estimate.add_estimate(step, _Cfg, {"stage": stages, "fsdp": 64}, V6E, micro)
  est, M = step["estimate"], micro or stages
  k = (M + stages - 1) / M
  assert est["compute_s"] == pytest.approx(2.0 * k) and est["hbm_s"] == pytest.approx(k)
  assert est["ici_s"] == pytest.approx(0.5)
  assert est["bubble"] == pytest.approx((stages - 1) / (M + stages - 1))
  assert est["bytes"]["stage_transfers"]["ici"] == 3e9
  flat = _step()
  estimate.add_estimate(flat, _Cfg, {"fsdp": 256}, V6E)
  assert "bubble" not in flat["estimate"] and flat["estimate"]["compute_s"] == 2.0

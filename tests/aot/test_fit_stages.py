"""The fit search over pipeline stages (train/aot/fit_stages.py) with a fake compile: CPU
only, no libtpu.

Properties: stage counts the config cannot pipeline are refused with the spec's reason
(layers that do not divide, MoE); each pipelined candidate's ESTIMATE is the unpipelined
step's compute and HBM at the same policy, scaled to its batch, through GPipe's bubble
(M + S - 1) / M, with its own transfers; microbatch counts the batch cannot split are
not compiled; the recommendation is the fastest candidate, its flags set the stages,
the microbatches and the batch, and the report says why; a re-run compiles nothing.
"""

import json

import pytest

from experiments.configs import pod
from train.aot import fit, fit_stages, report
from train.aot.topology import parse_topology

TOPO = parse_topology("v5e:2x2")


def _fake(calls, limits, compute_s=1.0, wire=1e9):
  """Per (remat, stages) the largest per-chip batch that fits; compute per sequence
  `compute_s` s at the unpipelined roofline; the pipeline's own wire bytes `wire` per
  sequence per chip."""
  hbm = report.capacity(TOPO)

  def fake(config, topo, roofline):
    S, M = int(config.mesh.stage), int(config.train.pipeline_microbatches)
    remat, b = config.model.remat, config.data.batch_size // topo.num_chips
    calls.append((remat, S, M, b, roofline))
    limit = limits[remat, S]
    s = {"fits": b <= limit, "hbm_bytes": hbm, "compile_s": 1.0,
         "memory": {"total": int(hbm * (b + .25) / (limit + .5))},
         "collectives": {"total": {"wire_bytes": wire * b}},
         "dcn_collectives": {"total": {"bytes": 0.0}}}
    if roofline:
      assert S == 1, "pipelined candidates are estimated from the unpipelined roofline"
      # The fsdp gathers (ICI) a fixed cost per step: a larger batch amortises them.
      est = {"compute_s": compute_s * b, "hbm_s": 0.5 * b, "ici_s": 3.0, "dcn_s": 0.0,
             "host_s": 0.0}
      step = max(est.values())
      tokens = b * config.data.seq_len * topo.num_chips
      s.update(roofline={"step_time_s": step}, tokens_per_s_estimate=tokens / step,
               estimate={**est, "step_time_s": step, "bound": "compute",
                         "tokens_per_s": tokens / step, "mfu": .5})
    return s
  return fake


def _config():
  c = pod.get_config("preset=1b,smoke")  # 2 layers: 2 stages, never 4.
  c.data.batch_size = 4
  return c


def test_stages_are_searched_estimated_through_the_bubble_and_recommended(tmp_path):
  calls, out = [], str(tmp_path / "fit.json")
  # Pipelined, full fits 4 per chip against 2 unpipelined; save_qkv_proj 2 against 1.
  limits = {("full", 1): 2, ("full", 2): 4, ("save_qkv_proj", 1): 1,
            ("save_qkv_proj", 2): 2}
  r = fit.fit_search(_config(), TOPO, compile_train=_fake(calls, limits), ceiling=8,
                     policies_asked=["full", "save_qkv_proj"], out=out, stages=(1, 2, 4))
  rows = r["pipeline"]
  assert [row["stages"] for row in rows if "refused" in row] == [4]
  assert "must divide into 4 equal" in rows[-1]["refused"]
  two = [row for row in rows if row["stages"] == 2]
  assert {(row["remat"], row["microbatches"], row["per_chip"]) for row in two} == {
      ("full", 2, 4), ("save_qkv_proj", 2, 2), ("full", 4, 4), ("full", 8, 4)}
  ref = {row["remat"]: row for row in r["policies"]}
  for row in two:
    S, M, b, est = 2, row["microbatches"], row["per_chip"], row["estimate"]
    k = (M + S - 1) / M
    scale = b / ref[row["remat"]]["per_chip"]
    assert est["bubble"] == pytest.approx((S - 1) / (M + S - 1))
    assert est["compute_s"] == pytest.approx(ref[row["remat"]]["estimate"]["compute_s"]
                                             * scale * k)
    assert est["ici_s"] == pytest.approx(1e9 * b / TOPO.chip.ici_bandwidth)
  assert not any(S == 2 and M == 16 for _, S, M, _, _ in calls)  # 4 x 2 / 16: no split.
  rec = r["recommended"]
  assert (rec["stages"], rec["microbatches"], rec["remat"], rec["per_chip"]) == \
      (2, 8, "full", 4)  # The smallest bubble at the largest batch.
  assert rec["flags"] == ("--config.data.batch_size=16 --config.model.remat=full "
                          "--config.mesh.stage=2 --config.train.pipeline_microbatches=8 "
                          "--config.train.telemetry=False")
  text = fit.format_fit(r)
  assert "stages=4: refused: " in text and "pipeline choice: 2 stages x 8 microbatches" in text
  assert text.splitlines()[-1] == f"recommended: {rec['flags']}"

  again = []
  r2 = fit.fit_search(_config(), TOPO, compile_train=_fake(again, limits), ceiling=8,
                      policies_asked=["full", "save_qkv_proj"], out=out, stages=(1, 2, 4))
  assert again == [] and r2["recommended"] == rec
  assert json.loads(open(out).read())["recommended"]["stages"] == 2


def test_a_pipeline_that_is_slower_is_not_recommended():
  calls = []
  # The same batch fits either way: the bubble only costs, so no pipeline wins.
  limits = {("full", 1): 4, ("full", 2): 4}
  r = fit.fit_search(_config(), TOPO, compile_train=_fake(calls, limits, wire=0.0),
                     ceiling=4, policies_asked=["full"], stages=(2,),
                     microbatch_factors=(1,))
  assert r["recommended"]["stages"] == 1 and "--config.mesh.stage" not in \
      r["recommended"]["flags"]
  assert "no pipeline, remat=full, 4 per chip" in r["recommended"]["why"]


def test_stages_the_config_cannot_run_are_refused_with_the_reason():
  """The run spec's own reason (2 layers never cut into 4 stages); an MoE is searched."""
  why = fit_stages.refusal(_config(), TOPO, 4)
  assert "model.num_layers" in why and "4 equal contiguous stages" in why
  assert fit_stages.refusal(_config(), TOPO, 2) is None
  assert fit_stages.refusal(pod.get_config("preset=moe,smoke"), TOPO, 2) is None


def test_a_fixed_fsdp_gives_the_stages_its_chips():
  c = _config()
  c.mesh.update(data=1, fsdp=4)
  assert fit_stages.refusal(c, TOPO, 2) is None
  p = fit_stages.pipelined(c, 2, 4)
  assert (p.mesh.fsdp, p.mesh.stage, p.train.pipeline_microbatches) == (2, 2, 4)
  assert not p.train.telemetry


def test_a_stage_count_that_fails_to_compile_is_reported_not_fatal():
  calls, limits = [], {("full", 1): 2, ("full", 2): 4}
  inner = _fake(calls, limits)

  def compile_train(config, topo, roofline):
    if int(config.mesh.stage) > 1:
      raise TypeError("while_loop body function carry input and carry output must have "
                      "equal types\nmore")
    return inner(config, topo, roofline)

  r = fit.fit_search(_config(), TOPO, compile_train=compile_train, ceiling=4,
                     policies_asked=["full"], stages=(1, 2))
  assert r["pipeline"] == [{"stages": 2, "refused": "the compile failed: TypeError: "
                            "while_loop body function carry input and carry output must "
                            "have equal types more"}]
  assert r["recommended"]["stages"] == 1 and r["recommended"]["per_chip"] == 2

"""The benchmark harness's JSON: every target of issue 8, each value the ratio of the
figures it names, `met` the comparison with its threshold.

The fast test builds targets from hand-made results (no compiles); every section's
smoke run is tests/benchmarks/test_sections_smoke.py.
"""

import json

import pytest

from benchmarks import table, targets

FIELDS = {"name", "value", "threshold", "op", "met"}


def _train(tps, mfu=0.5):
  return {"tokens_per_s": tps, "mfu": mfu, "mfu_vs_f32_peak": mfu, "step_ms": 1e3 / tps}


def _decode(batch, new, step_ms, tps):
  return {"layout": "GQA", "batch": batch, "new_tokens": new, "step_ms": step_ms,
          "decode_tokens_per_s": tps, "cache_bytes": 2**20}


def fake_results():
  return {
      "roofline": {"float32": 1e11, "bfloat16": 2e11},
      "train": {
          "project": {"S": {"float32": _train(300), "bfloat16": _train(500)},
                      "M": {"float32": _train(100, 0.65), "bfloat16": _train(150)},
                      "MoE-S": {"float32": _train(90), "bfloat16": _train(100)}},
          "reference": {"S": {**_train(150), "arch": "LlamaForCausalLM"},
                        "M": {**_train(200), "arch": "LlamaForCausalLM"},
                        "MoE-S": {**_train(45), "arch": "MixtralForCausalLM"}},
          "loss_curves": {"config": "S", "steps": 200, "data": "x", "max_block_gap": 0.01,
                          "float32": [2.0], "bfloat16": [2.01]}},
      "moe": {"results": [
          {"dispatch": d, "devices": n, "step_ms": r * 10, "dense_step_ms": 10.0,
           "ratio_vs_dense": r}
          for d, n, r in (("capacity", 1, 1.2), ("dropless", 1, 1.4), ("default", 1, 1.25),
                          ("expert_parallel", 8, 1.3))]},
      "compile": {"layers": [4, 32], "results": [
          {"layers": n, "scan": s, "lower_s": 1.0, "compile_s": t - 1.0, "total_s": t}
          for n, s, t in ((4, True, 10.0), (32, True, 16.0), (4, False, 10.0),
                          (32, False, 80.0))]},
      "memory": {"results": {"none": {"peak_bytes": 2**30, "temp_bytes": 2**29,
                                      "argument_bytes": 2**28}}},
      "decode": {"positions": [16, 240],
                 "project": {"results": [_decode(1, 16, 2.0, 500), _decode(1, 240, 2.1, 476),
                                         _decode(8, 16, 3.0, 2667), _decode(8, 240, 3.6, 2222)]},
                 "reference": {"arch": "LlamaForCausalLM", "decode_tokens_per_s": 250.0,
                               "latency_ms": {"16": 4.0, "240": 4.1}}},
  }


def test_targets_are_the_named_ratios_and_met_is_their_comparison():
  results = fake_results()
  got = {t["name"]: t for t in targets.build(results)}
  assert set(got) == set(targets.NAMES) and len(got) == len(targets.NAMES) == 14
  for t in got.values():
    assert FIELDS <= set(t)
    assert t["met"] == targets.OPS[t["op"]](t["value"], t["threshold"])
  expected = {  # value, met
      "train_f32_tokens_per_s_vs_reference_S": (2.0, True),
      "train_f32_tokens_per_s_vs_reference_M": (0.5, False),
      "train_f32_mfu_M": (0.65, True),
      "train_bf16_vs_f32_tokens_per_s_M": (1.5, False),
      "train_bf16_loss_curve_gap": (0.01, True),
      "train_moe_s_tokens_per_s_vs_reference_mixtral": (2.0, True),
      "moe_s_step_vs_dense_capacity": (1.2, True),
      "moe_s_step_vs_dense_dropless": (1.4, False),
      "moe_s_step_vs_dense_default": (1.25, True),
      "moe_s_step_vs_dense_expert_parallel": (1.3, True),  # <= is inclusive.
      "compile_scanned_32_vs_4_layers": (1.6, False),
      "decode_latency_240_vs_16_M_B1": (1.05, True),
      "decode_latency_240_vs_16_M_B8": (1.2, False),
      "decode_tokens_per_s_vs_reference_M_B1": (476 / 250, True),
  }
  for name, (value, met) in expected.items():
    assert got[name]["value"] == pytest.approx(value), name
    assert got[name]["met"] is met, name
  # The whole results dict, targets included, is plain JSON.
  results["targets"] = list(got.values())
  assert json.loads(json.dumps(results))["targets"] == results["targets"]
  text = table.format_results(results)
  assert all(name in text for name in targets.NAMES)


def test_a_missing_section_is_not_met():
  results = fake_results()
  del results["moe"]
  results["train"]["reference"].pop("M")
  got = {t["name"]: t for t in targets.build(results)}
  missing = {n for n, t in got.items() if t["value"] is None}
  assert missing == {"moe_s_step_vs_dense_capacity", "moe_s_step_vs_dense_dropless",
                     "moe_s_step_vs_dense_default",
                     "moe_s_step_vs_dense_expert_parallel",
                     "train_f32_tokens_per_s_vs_reference_M"}
  assert not any(got[n]["met"] for n in missing)
  rows = table.targets_table(list(got.values()))
  assert sum("NOT MEASURED" in row for row in rows) == len(missing)


def test_attention_block_target_is_the_worst_auto_over_best():
  """auto_block's choice against the fastest block, worst case over the swept rows."""
  from benchmarks import attention  # pylint: disable=g-import-not-at-top
  sweep = [{"batch": b, "heads": h, "rows": b * h, "L": 1024, "auto": a, "auto_vs_best": r,
            "step_ms": {"256": 10.0, "128": 10.0 * r, "64": 12.0}}
           for b, h, a, r in ((1, 4, 256, 1.0), (8, 8, 128, 1.2))]
  got = {t["name"]: t for t in attention.targets({"blocks": {"L": 1024, "results": sweep}})}
  block = got["attention_auto_block_vs_best"]
  assert (block["value"], block["met"]) == (1.2, False)
  assert got["attention_time_blockwise_vs_xla_L2048"]["value"] is None  # Unmeasured.
  assert not got["attention_time_blockwise_vs_xla_L2048"]["met"]
  assert "| 8 x 8 (64) | 1024 | 10.0 | 12.0 | 12.0 | 128 | 1.20 |" in attention.block_table(
      {"blocks": {"results": sweep}})
  assert attention.targets({})[-1]["value"] is None


def test_the_busy_warning_counts_other_processes_not_the_benchmark():
  """The issue's idle machine: the run's own threads made the load average 1.8 on 2 cores;
  other processes used 0.1 of a core. No warning; a machine others keep busy gets one."""
  idle = {"backend": "cpu", "cpu_count": 2, "load_avg_1min_at_start": 0.1,
          "load_avg_1min_at_end": 1.8, "other_processes_cores": 0.1}
  assert table.busy_warning(idle) == []
  busy = table.busy_warning({**idle, "other_processes_cores": 1.6})
  assert busy[0].startswith("WARNING: busy machine (other processes kept 1.6 of 2 cores")
  old = table.busy_warning({k: v for k, v in idle.items() if k != "other_processes_cores"})
  assert "this benchmark's own threads included" in old[0]  # What it measured, said.

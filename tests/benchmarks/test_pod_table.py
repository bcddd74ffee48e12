"""benchmarks/pod_table.py's rows say where a roofline estimate cannot be trusted: a
train step's compiled FLOPs below the model's (XLA did not count them all, so the step
time is too short), or far above them (worst-case buffers costed in full)."""

import pytest

from benchmarks import pod_table


def _report(xla_flops: float) -> dict:
  train = {"shapes": {"batch": 8, "length": 4096}, "fits": True, "hbm_bytes": 16 * 2**30,
           "memory": {"total": 2**33, "arguments": 2**30, "temporaries": 7 * 2**30},
           "roofline": {"bound": "compute", "compute_s": 0.4, "hbm_s": 0.25,
                        "collective_s": 0.1, "step_time_s": 0.4},
           "tokens_per_s_estimate": 8e4,
           "mfu_estimate": 0.5, "model_flops_per_chip": 1e14,
           "cost": {"flops": xla_flops - 1e13, "kernel_flops": 1e13}}
  return {"steps": {"train": train}, "chips": 4, "config": "pod_1b", "params": 1.2e9,
          "topology": "v5e:2x2", "remat": "full", "command": ["launch.py", "--out", "x.json"], "wall_s": 60,
          "load": (1.0, 1.0, 1.0)}


def test_rows_flag_a_flop_count_below_or_far_above_the_models():
  assert pod_table.flop_ratio(_report(1.3e14)["steps"]["train"]) == 1.3
  trusted, low, high = (pod_table.markdown([_report(f)]).splitlines()[2]
                        for f in (1.3e14, 0.8e14, 3e14))
  assert "trusted" not in trusted and "pessimistic" not in trusted and "| 1.30 |" in trusted
  assert "**not trusted**" in low and "| 0.80 |" in low
  assert "**pessimistic**: XLA costs 3.0x" in high


def test_the_int8_estimate_runs_the_quantized_share_at_the_int8_peak_and_keeps_hbm():
  r = _report(1.3e14)
  # v5e: int8 peak twice bf16's. Half the compute quantized: 0.4 -> 0.3 s, still the bound.
  assert pod_table.int8_tokens_per_chip(r, 0.5) == pytest.approx(8e4 * 0.4 / 0.3 / 4)
  # All of it: 0.2 s of compute, under the HBM time (0.25 s), which becomes the step.
  assert pod_table.int8_tokens_per_chip(r, 1.0) == pytest.approx(8e4 * 0.4 / 0.25 / 4)
  share = pod_table.int8_share("1b", 4096)
  assert 0.5 < share < 1  # Projections and FFN: most, not all (head, attention, router).
  assert "(+55%) | - |" in pod_table.markdown([r]).splitlines()[2]  # share 0.71 for 1b.

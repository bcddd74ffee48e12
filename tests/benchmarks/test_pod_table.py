"""benchmarks/pod_table.py's rows say where a roofline estimate cannot be trusted: a
train step's compiled FLOPs below the model's (XLA did not count them all, so the step
time is too short), or far above them (worst-case buffers costed in full)."""

from benchmarks import pod_table


def _report(xla_flops: float) -> dict:
  train = {"shapes": {"batch": 8, "length": 4096}, "fits": True, "hbm_bytes": 16 * 2**30,
           "memory": {"total": 2**33, "arguments": 2**30, "temporaries": 7 * 2**30},
           "roofline": {"bound": "compute"}, "tokens_per_s_estimate": 8e4,
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

"""experiments/configs/quant_ablation.py: its points, and the report's interaction table
(experiments/report/interaction.py) against the arithmetic done by hand."""

import pytest

from experiments.configs import quant_ablation
from experiments.report import interaction, stats


def test_points_cross_schemes_with_mha_gqa_mqa_and_seeds():
  pts = quant_ablation.sweep("cpu")
  assert len(pts) == 3 * 3 * 3
  assert {(p["model.quantization"], p["model.num_kv_heads"]) for p in pts} == {
      (q, k) for q in ("none", "int8", "fp8") for k in (4, 2, 1)}
  c = quant_ablation.get_config("cpu")
  assert c.model.dtype == "bfloat16" and c.model.num_heads == 4
  with pytest.raises(ValueError, match="starting with none"):
    quant_ablation.get_config("schemes=int8+none")
  with pytest.raises(ValueError, match="schemes"):
    quant_ablation.get_config("schemes=none+int4")


def _group(q, k, losses):
  return {"label": f"{q}-kv{k}", "model.quantization": q, "model.num_kv_heads": k,
          "n": len(losses), "_obs": {"final_loss": list(enumerate(losses))}}


def test_interaction_is_the_paired_difference_of_the_per_seed_deltas():
  groups = [_group("none", 4, [2.00, 2.10, 2.05]), _group("int8", 4, [2.01, 2.11, 2.06]),
            _group("none", 1, [2.20, 2.30, 2.25]), _group("int8", 1, [2.25, 2.33, 2.31])]
  text = interaction.table(groups, ["model.num_kv_heads", "model.quantization"])
  d_mqa, d_mha = [0.05, 0.03, 0.06], [0.01, 0.01, 0.01]
  want = stats.interval_cell(*stats.paired(d_mqa, d_mha))
  row = next(line for line in text.splitlines() if line.startswith("| 1 | int8"))
  assert want in row and "+0.0467" in row  # Mean of 0.04, 0.02, 0.05.
  assert "(reference)" in next(l for l in text.splitlines() if l.startswith("| 4 | int8"))
  assert interaction.table(groups, ["model.num_kv_heads"]) == ""  # Not this sweep.

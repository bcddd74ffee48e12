"""Quantized training compiled for a TPU (v5e:2x2, libtpu): the compiled train step's
matmuls multiply int8 operands in every projection (forward and backward), the head stays
bfloat16, and the roofline runs those int8 FLOPs at the chip's int8 peak. fp8 compiles
too; v5e has no fp8 MXU, so its roofline stays at the bfloat16 peak."""

import json

import pytest

from experiments.configs import pod
from model.flops import quantized_params_per_token, training_flops_per_token
from tests.cli import launch
from train.aot import libtpu_available
from train.aot.topology import CHIPS
from train.spec import model_config

pytestmark = [pytest.mark.aot, pytest.mark.skipif(
    not libtpu_available(), reason="libtpu is not installed: make test-aot")]
SMOKE = "experiments/configs/pod.py:preset=1b,smoke"
PROJECTIONS = {f"layers/attn/{p}" for p in "qkvo"} | {f"layers/ffn/{p}" for p in
                                                       ("wi", "wg", "wo")}


def _compile(tmp_path, quantization: str) -> dict:
  out = tmp_path / f"{quantization}.json"
  printed = launch("--mode", "compile", "--config", SMOKE, "--topology", "v5e:2x2",
                   f"--config.model.quantization={quantization}", "--out", str(out))
  assert "matmuls per step:" in printed
  return json.loads(out.read_text())["steps"]["train"]


def test_int8_dots_in_every_projection_and_the_int8_peak_in_the_roofline(tmp_path):
  train = _compile(tmp_path, "int8")
  s8 = train["matmuls"]["s8"]
  assert set(s8["modules"]) == PROJECTIONS, s8["modules"]
  # Forward, and both backward dots (bwd int8), of each projection, per layer (2 layers).
  assert all(n >= 2 * 3 for n in s8["modules"].values()), s8["modules"]
  # What stays bfloat16 is the head (its metadata may be fused away: "?"), no projection.
  assert not set(train["matmuls"]["bf16"]["modules"]) & PROJECTIONS
  chip, roof = CHIPS["v5e"], train["roofline"]
  flops = train["cost"]["flops"] + train["cost"]["kernel_flops"]
  cfg = model_config(pod.get_config("preset=1b,smoke"))
  L = train["shapes"]["length"]
  share = 6 * quantized_params_per_token(cfg) / training_flops_per_token(cfg, L)
  low = share * flops  # The quantized dots' share of the step's FLOPs: the model's.
  want = (flops - low) / chip.peak_flops + low / chip.int8_peak_flops
  assert roof["compute_s"] == pytest.approx(want, rel=1e-9)
  assert roof["compute_s"] < flops / chip.peak_flops


def test_fp8_compiles_with_fp8_operands_at_the_bfloat16_peak(tmp_path):
  train = _compile(tmp_path, "fp8")
  kinds = set(train["matmuls"]) - {"total"}
  assert "s8" not in kinds and any("f8e4m3fn" in k for k in kinds), kinds
  flops = train["cost"]["flops"] + train["cost"]["kernel_flops"]
  assert train["roofline"]["compute_s"] == pytest.approx(flops / CHIPS["v5e"].peak_flops)

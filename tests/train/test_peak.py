"""The MFU peak (train/peak.py, issue 28 item 1): where it comes from, and never an MFU
above 1 when a peak timed on a busy machine is outpaced."""

import logging

from train import peak as peak_lib


def test_a_measured_peak_the_run_outpaces_is_measured_again_and_mfu_stays_at_most_one(
    monkeypatch, caplog):
  timings = iter([1e9, 3e9, 3e9])  # Startup on a busy machine, then re-measured.
  monkeypatch.setattr(peak_lib, "measure_peak_flops", lambda *a, **k: next(timings))
  caplog.set_level(logging.INFO, logger=peak_lib.__name__)
  peak = peak_lib.Peak(0.0, "float32", "cpu")
  assert "measured at startup: the best of 10" in caplog.records[0].getMessage()
  assert peak.utilization(0.5e9) == 0.5
  assert peak.utilization(2e9) == 2e9 / 3e9  # Re-measured: 3e9.
  assert peak.utilization(4e9) == 1.0  # Above even that: the peak is what was achieved.
  assert any("above the MFU peak" in r.getMessage() for r in caplog.records)


def test_the_published_peak_of_a_known_device_is_used_and_named(caplog):
  caplog.set_level(logging.INFO, logger=peak_lib.__name__)
  peak = peak_lib.Peak(0.0, "bfloat16", "NVIDIA H100 80GB HBM3")
  assert peak.value == 989e12 and not peak.measured
  assert "the published bfloat16 peak of a NVIDIA H100" in caplog.records[0].getMessage()
  assert peak_lib.Peak(5e12, "bfloat16", "TPU v4").source == "hardware.peak_flops"

"""Progress for long work (HF import / export, sweeps): quiet unless asked for."""

import logging

from train.metrics import Countdown, progress


def test_progress_off_a_terminal_logs_tenths_at_info_and_prints_nothing(caplog, capsys):
  with caplog.at_level(logging.INFO, logger="train.metrics"):
    assert list(progress(iter(range(25)), 25, "writing model.safetensors")) == list(range(25))
  lines = [r.getMessage() for r in caplog.records]
  # Every 2nd of 25 items (a tenth, rounded down), and the last.
  assert len(lines) == 13 and lines[-1].startswith("writing model.safetensors: 25/25 done")
  assert capsys.readouterr() == ("", "")  # Test and log output stay clean: no bar.


def test_countdown_counts_and_estimates():
  c = Countdown(4)
  c.t0 -= 10  # Two items took 10 s: two more take about 10 s.
  c.tick()
  assert c.tick() == "2/4 done, 00:00:10 elapsed, ETA 00:00:10"

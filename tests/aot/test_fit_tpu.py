"""`launch.py --mode compile --fit` on a tiny config for v5e:2x2 (libtpu; the aot tier).

Properties (issue 46): --fit_policies searches only the policies named, full first; each
trial prints its policy, per-chip batch, HBM and verdict with the elapsed time, and the
JSON holds every earlier trial before the next compile starts; the same command again
compiles nothing and recommends the same flags; SIGTERM mid-search exits 143 with the
finished trials kept (and no libtpu crash dump), and the next run reuses them.
"""

import json
import re
import signal
import subprocess
import time

import pytest

from tests.cli import fail_if_crashed, launch, launch_cmd
from train.aot import fit, libtpu_available

pytestmark = [pytest.mark.aot, pytest.mark.skipif(
    not libtpu_available(), reason="libtpu is not installed: make test-aot")]
FIT = ("--mode", "compile", "--fit", "--fit_policies=save_qkv_proj,full", "--noroofline",
       "--fit_max_per_chip=2", "--config", "experiments/configs/pod.py:preset=1b,smoke",
       "--topology", "v5e:2x2", "--config.mesh.data=2", "--config.mesh.fsdp=2")


def test_fit_writes_each_trial_and_a_rerun_compiles_nothing(tmp_path, monkeypatch):
  out = tmp_path / "fit.json"
  real, before = fit._compile_train, []  # pylint: disable=protected-access

  def counted(config, topo, roofline):
    before.append(len(json.loads(out.read_text())["trials"]) if out.exists() else 0)
    return real(config, topo, roofline)

  monkeypatch.setattr(fit, "_compile_train", counted)
  printed = launch(*FIT, "--out", str(out))
  r = json.loads(out.read_text())
  assert r["fit_policies"] == ["full", "save_qkv_proj"] and r["finished"]
  assert [row["remat"] for row in r["policies"]] == ["full", "save_qkv_proj"]
  assert all(row["per_chip"] == 2 for row in r["policies"]), r["policies"]
  assert before == list(range(len(r["trials"])))  # Each compile saw every earlier trial.
  clock = r"[\d mins]+"  # "7 s", "1 min 02 s".
  for t in r["trials"]:
    assert re.search(rf"fit \[{clock}\]: remat={t['remat']}, {t['per_chip']} x 32 per chip: "
                     rf"[\d.]+ MiB of 15.75 GiB -> fits \(compiled in {clock}\)", printed), printed
  rec = r["recommended"]
  assert printed.strip().splitlines()[-2] == f"recommended: {rec['flags']}"
  assert r["config_fields"]["data.seq_len"] == 32

  def refuse(*_):
    raise AssertionError("a re-run compiled a trial its ledger holds")
  monkeypatch.setattr(fit, "_compile_train", refuse)
  again = launch(*FIT, "--out", str(out))
  assert f"({len(r['trials'])} memory-only trials, {len(r['trials'])} of them reused" in again
  assert json.loads(out.read_text())["recommended"] == rec


def test_sigterm_keeps_the_finished_trials_and_exits_143(tmp_path):
  out = tmp_path / "fit.json"
  cmd = launch_cmd(*FIT, "--out", str(out))
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 300
  while not out.exists() and time.time() < deadline and proc.poll() is None:
    time.sleep(0.2)
  proc.send_signal(signal.SIGTERM)  # During the next trial's lowering or compile.
  stdout, stderr = proc.communicate(timeout=120)
  assert proc.returncode == 143, (proc.returncode, stdout[-2000:], stderr[-3000:])
  assert "SIGTERM received" not in stderr and "FailureSignalHandler" not in stderr, stderr
  assert "fit: stopped by SIGTERM after 1 trials" in stdout, stdout
  partial = json.loads(out.read_text())
  assert not partial["finished"] and len(partial["trials"]) == 1
  done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=600)
  fail_if_crashed(cmd, done.returncode, done.stdout + done.stderr)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "1 of them reused" in done.stdout
  assert json.loads(out.read_text())["trials"][0] == partial["trials"][0]

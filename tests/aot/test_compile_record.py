"""A compile report says what it compiled, and runs that differ never share a file
(issue 46 item 3).

Properties: the JSON records the resolved config (the fields that change memory, and the
whole config), so an override is seen to have taken effect; the default --out name holds
the batch, the sequence length and a hash of the config, distinct for runs that differ
in any of them and the same for the same command (so --fit resumes).
"""

import glob
import json
import os

import pytest

from experiments.configs import pod
from tests.cli import ROOT, launch
from train.aot import libtpu_available, parse_topology
from train.aot.report import config_hash, default_out


def _config(**changes):
  c = pod.get_config("preset=1b,smoke")
  for path, value in changes.items():
    section, field = path.split("__")
    c[section][field] = value
  return c


def test_default_out_names_tell_runs_apart():
  topo = parse_topology("v5e-16")
  base = default_out(_config(), topo, fit=False)
  others = [default_out(_config(**c), topo, fit=False) for c in (
      {"data__batch_size": 64}, {"data__seq_len": 16}, {"model__rope_scaling": "yarn"},
      {"model__remat": "full"})]
  others += [default_out(_config(), parse_topology("v5e-64"), fit=False),
             default_out(_config(), topo, fit=True)]
  assert len({base, *others}) == 1 + len(others), others
  assert base == default_out(_config(), topo, fit=False)  # The same run: the same file.
  c = _config()
  assert os.path.basename(base) == (f"pod_1b-v5e_4x4-b{c.data.batch_size}-"
                                    f"L{c.data.seq_len}-{config_hash(c)}.json")


@pytest.mark.aot
@pytest.mark.skipif(not libtpu_available(), reason="libtpu is not installed: make test-aot")
def test_the_report_records_the_config_it_compiled(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # The default --out is relative: runs/compile/...
  launch("--mode", "compile", "--config",
         os.path.join(ROOT, "experiments/configs/pod.py:preset=1b,smoke"),
         "--topology", "v5e:2x2", "--compile_steps", "train", "--noroofline",
         "--config.data.seq_len=16", "--config.model.rope_scaling=linear",
         "--config.model.rope_scaling_factor=2.0", "--config.model.remat=full")
  files = glob.glob(str(tmp_path / "runs" / "compile" / "*.json"))
  assert len(files) == 1 and "-b8-L16-" in os.path.basename(files[0]), files
  r = json.loads(open(files[0]).read())
  assert r["config_hash"] in os.path.basename(files[0])
  fields = r["config_fields"]
  assert (fields["data.seq_len"], fields["model.rope_scaling"],
          fields["model.rope_scaling_factor"], fields["model.remat"]) == (16, "linear", 2.0,
                                                                          "full")
  assert fields["model.dtype"] == "bfloat16" and fields["mesh"]["data"] == -1
  assert r["mesh"]["data"] == 4  # The report's own mesh: resolved.
  assert r["config_resolved"]["data"]["seq_len"] == 16
  assert r["steps"]["train"]["shapes"]["length"] == 16

"""`launch.py --mode import` as a user runs it: a run directory is never overwritten, and a
truncated or corrupt safetensors file is refused naming the file and what is wrong.

The HF model directories are written by export_hf_dir from random weights (no torch).
"""

import json
import os
import shutil
import struct

import numpy as np
import pytest

from interop import export_hf_dir
from interop.hf import read_safetensors, write_safetensors
from model import ModelConfig
from tests.cli import launch
from tests.interop.test_hf_weights import init
from train.lifecycle.config_record import contents

CFG = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  mlp_dim=48, max_seq_len=32)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  params, state = init(CFG)
  return export_hf_dir((CFG, {"params": params, **state}),
                       str(tmp_path_factory.mktemp("hf") / "tiny"))


def snapshot(root) -> dict[str, bytes]:
  """Every file under `root` (relative path -> bytes), and every directory (-> None)."""
  out = {}
  for d, dirs, files in os.walk(root):
    for name in dirs:
      out[os.path.relpath(os.path.join(d, name), root)] = None
    for name in files:
      with open(os.path.join(d, name), "rb") as f:
        out[os.path.relpath(os.path.join(d, name), root)] = f.read()
  return out


def test_import_writes_a_new_run_and_refuses_to_import_over_it(hf_dir, tmp_path):
  run = str(tmp_path / "run")
  assert "imported" in launch("--mode", "import", "--hf_dir", hf_dir, "--workdir", run)
  held = contents(run)
  assert held == ["config.json", "checkpoints at steps [0]"]
  before = snapshot(run)
  with pytest.raises((ValueError, FileExistsError)) as e:
    launch("--mode", "import", "--hf_dir", hf_dir, "--workdir", run)
  assert run in str(e.value) and all(item in str(e.value) for item in held)
  assert snapshot(run) == before


def test_import_refuses_a_trained_run_and_leaves_it_byte_identical(hf_dir, tmp_path):
  run = tmp_path / "run"
  os.makedirs(run / "checkpoints" / "12")
  (run / "checkpoints" / "12" / "state").write_bytes(b"weights")
  (run / "config.json").write_text(json.dumps({"name": "trained"}))
  (run / "metrics.jsonl").write_text(json.dumps({"step": 12, "split": "train", "loss": 1.5})
                                     + "\n")
  held = contents(str(run))
  assert len(held) == 3
  before = snapshot(run)
  with pytest.raises((ValueError, FileExistsError)) as e:
    launch("--mode", "import", "--hf_dir", hf_dir, "--workdir", str(run))
  assert str(run) in str(e.value) and all(item in str(e.value) for item in held)
  assert snapshot(run) == before


def test_truncated_safetensors_is_refused_naming_the_file(hf_dir, tmp_path):
  bad = str(tmp_path / "hf")
  shutil.copytree(hf_dir, bad)
  path = os.path.join(bad, "model.safetensors")
  size = os.path.getsize(path)
  with open(path, "r+b") as f:
    f.truncate(size - 100)
  with pytest.raises(ValueError, match=r"model\.safetensors: truncated: header says tensor "
                     r"'.+' ends at byte \d+ but the file has \d+ data bytes"):
    launch("--mode", "import", "--hf_dir", bad, "--workdir", str(tmp_path / "run"))
  assert contents(str(tmp_path / "run")) == []


def _rewrite(path, header_len=None, header=None, cut=None):
  """The file at `path` with its header length, header bytes or length replaced."""
  with open(path, "rb") as f:
    blob = f.read()
  (n,) = struct.unpack("<Q", blob[:8])
  head, data = blob[8:8 + n], blob[8 + n:]
  head = head if header is None else header
  blob = struct.pack("<Q", len(head) if header_len is None else header_len) + head + data
  with open(path, "wb") as f:
    f.write(blob[:cut])


def _bad_offsets(path):
  with open(path, "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(n))
  header["w"]["data_offsets"] = [0, 8]  # 2 floats' bytes for a [3, 4] float32 tensor.
  return json.dumps(header).encode()


@pytest.mark.parametrize("damage, message", [
    (lambda p: _rewrite(p, cut=5), r"truncated: 5 bytes, shorter than the 8-byte"),
    (lambda p: _rewrite(p, header_len=10**9), r"header length says 1000000000 bytes"),
    (lambda p: _rewrite(p, header=b"{not json" + b" " * 7), r"header is not JSON"),
    (lambda p: _rewrite(p, header=_bad_offsets(p)),
     r"tensor 'w' has data_offsets \[0, 8\] \(8 bytes\) but shape \[3, 4\] of F32 needs 48"),
], ids=["shorter_than_8_bytes", "header_longer_than_file", "header_not_json",
        "offsets_disagree_with_shape"])
def test_corrupt_safetensors_is_refused_naming_the_file(tmp_path, damage, message):
  path = str(tmp_path / "x.safetensors")
  write_safetensors(path, {"w": np.ones((3, 4), np.float32), "b": np.arange(5, dtype=np.int64)})
  assert read_safetensors(path)["w"].shape == (3, 4)
  damage(path)
  with pytest.raises(ValueError, match="x.safetensors: .*" + message):
    read_safetensors(path)


def test_a_transposed_lm_head_is_refused_naming_the_files_tensor(hf_dir, tmp_path):
  bad = str(tmp_path / "transposed")
  shutil.copytree(hf_dir, bad)
  path = os.path.join(bad, "model.safetensors")
  tensors = read_safetensors(path)
  assert tensors["lm_head.weight"].shape == (64, 32)  # [vocab_size, hidden_size]
  tensors["lm_head.weight"] = np.ascontiguousarray(tensors["lm_head.weight"].T)
  write_safetensors(path, tensors)
  with pytest.raises(ValueError, match=r"tensor 'lm_head.weight' has shape \(32, 64\) "
                     r"\(transposed\?\); the config \(vocab_size=64, hidden_size=32\) needs "
                     r"\(64, 32\) \[vocab_size, hidden_size\]"):
    launch("--mode", "import", "--hf_dir", bad, "--workdir", str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()

"""The reading modes of launch.py on a bucket run (moto's S3 server and the local GCS
server, fixture `bucket`): generate, export and convert --from_run read it (slow tier:
three compiles beside the training)."""

import os

from tests.cli import launch
from train.io import storage


def test_generate_export_and_convert_read_a_bucket_run(bucket, tmp_path):
  run = storage.join(bucket, "run")
  launch("--workdir", run, "--config.train.steps=2", "--config.train.tensorboard=False")
  before = sorted(storage.glob(storage.join(run, "**")))
  out = launch("--mode", "generate", "--workdir", run, "--prompt", "RO", "--max_new_tokens",
               "4", "--temperature", "0")
  assert out.strip()
  hf = tmp_path / "hf"
  launch("--mode", "export", "--workdir", run, "--hf_dir", str(hf))
  assert (hf / "config.json").exists() and any(p.suffix == ".safetensors" for p in hf.iterdir())
  dst = tmp_path / "gqa"
  launch("--mode", "convert", "--from_run", run, "--workdir", str(dst),
         "--config.model.num_kv_heads=1")
  assert (dst / "config.json").exists()
  assert sorted(storage.glob(storage.join(run, "**"))) == before  # Reading never writes.
  assert not os.path.exists(bucket.split("//")[0])

"""Checkpoints in a bucket (moto's S3 server and the local GCS server of
tests/gcs_server.py, started by the tests): orbax writes the arrays through TensorStore's
s3 / gcs driver, a step counts only with its commit marker, and the checksums and the
fallback work as they do on a local disk (train/checkpoint.py)."""

import json

import jax
import jax.numpy as jnp
import dataclasses
import numpy as np
import optax
import pytest

from train import checkpoint
from train.io import checkpoint_store, checksums, storage
from train.io.checksums import CHECKSUMS_FILE, CheckpointDamaged
from train.spec import TrainSpec
from train.state import make_state

TRAIN = TrainSpec(keep_checkpoints=3, keep_every=0, async_checkpoint=False)


def _state(scale: float):
  params = {"w_DF": jnp.arange(24.0).reshape(4, 6) * scale, "b_F": jnp.ones(6) * scale}
  return make_state(params, {}, optax.adam(1e-3), seed=0)


def _restore(manager, workdir, **kw):
  template = _state(0.0)
  shardings = jax.tree.map(lambda x: x.sharding, template)
  return checkpoint.restore_latest(manager, workdir, template, shardings, **kw)


def _saved(workdir, steps=(1, 2), async_checkpoint=False):
  train = dataclasses.replace(TRAIN, async_checkpoint=async_checkpoint)
  manager = checkpoint.make_manager(workdir, train)
  for s in steps:
    checkpoint.save(manager, s, _state(float(s)), {"index": s})
  checkpoint.seal(manager)  # As the trainer's exit: waits for the last save.
  manager.close()


@pytest.mark.parametrize("async_checkpoint", [False, True])
def test_a_bucket_checkpoint_round_trips_through_tensorstore_with_its_checksums(
    bucket, async_checkpoint):
  workdir = f"{bucket}/run"
  _saved(workdir, async_checkpoint=async_checkpoint)
  step_dir = f"{workdir}/checkpoints/2"
  found = storage.files(step_dir)
  assert {"commit_success.txt", "state/commit_success.txt", CHECKSUMS_FILE,
          "state/manifest.ocdbt"} <= set(found)
  assert any(k.startswith("state/ocdbt.process_0/d/") for k in found)  # TensorStore's data.
  record = json.loads(storage.read_text(f"{step_dir}/{CHECKSUMS_FILE}"))
  assert record["format"] == checksums.FORMAT
  assert set(record["files"]) == set(found) - {CHECKSUMS_FILE}
  assert all("tag" in e and {"md5", "crc32", "crc32c"} & set(e) for e in record["files"].values())
  reads = storage.REQUESTS["read"]
  checksums.verify(checkpoint.checkpoint_dir(workdir), 2)  # Untouched: tags, no download.
  assert storage.REQUESTS["read"] - reads == 1  # CHECKSUMS.json itself.
  manager = checkpoint.make_manager(workdir, read_only=True)
  state, data = _restore(manager, workdir)
  assert int(state.step) == 0 and data == {"index": 2}
  np.testing.assert_array_equal(state.params["w_DF"], np.arange(24.0).reshape(4, 6) * 2)


def test_a_corrupted_object_is_named_and_the_trainer_falls_back_moving_it_aside(
    bucket, caplog):
  workdir = f"{bucket}/run"
  _saved(workdir)
  step_dir = f"{workdir}/checkpoints/2"
  data_file = max((k for k in storage.files(step_dir) if "/d/" in k),
                  key=lambda k: storage.files(step_dir)[k])
  blob = bytearray(storage.read_bytes(f"{step_dir}/{data_file}"))
  blob[len(blob) // 2] ^= 0xFF
  storage.write_bytes(f"{step_dir}/{data_file}", bytes(blob))
  reader = checkpoint.make_manager(workdir, read_only=True)
  template = _state(0.0)
  with pytest.raises(CheckpointDamaged, match=f"checkpoints/2 is damaged: {data_file} differs"):
    checkpoint.restore_step(reader, 2, template, jax.tree.map(lambda x: x.sharding, template))
  trainer = checkpoint.make_manager(workdir, TRAIN)
  state, data = _restore(trainer, workdir, move_aside=True)
  assert data == {"index": 1} and float(state.params["b_F"][0]) == 1.0
  assert "step 2 failed to restore (CheckpointDamaged" in caplog.text
  assert list(trainer.all_steps()) == [1]
  moved = storage.files(f"{workdir}/checkpoints_corrupt/2")
  assert data_file in moved and "commit_success.txt" in moved  # Kept whole, aside.
  assert not storage.files(step_dir)


def test_a_step_without_its_commit_marker_is_never_listed_or_restored(bucket):
  """A host killed mid-save leaves a step directory with no commit_success.txt (orbax
  writes it last): orbax lists only committed steps, and resume takes the one before."""
  workdir = f"{bucket}/run"
  _saved(workdir)
  storage.delete(f"{workdir}/checkpoints/2/commit_success.txt")
  reader = checkpoint.make_manager(workdir, read_only=True)
  assert list(reader.all_steps()) == [1]
  state, data = _restore(reader, workdir)
  assert data == {"index": 1}
  assert storage.files(f"{workdir}/checkpoints/2")  # A reader leaves it.
  trainer = checkpoint.make_manager(workdir, TRAIN)
  assert list(trainer.all_steps()) == [1]
  checkpoint.save(trainer, 3, _state(5.0), {"index": 5})  # Waits for the trainer's cleanup.
  trainer.close()
  assert not storage.files(f"{workdir}/checkpoints/2")  # The unfinished step is gone.
  state, data = _restore(checkpoint.make_manager(workdir, read_only=True), workdir)
  assert data == {"index": 5}


def test_a_protocol_tensorstore_cannot_write_is_refused_by_name():
  with pytest.raises(ValueError, match="memory://.*TensorStore.*not memory://"):
    checkpoint_store.check("memory://bucket/run/checkpoints")


def test_a_bucket_checkpoint_with_keys_in_the_environment_logs_no_aws_file_errors(
    s3_bucket, capfd, tmp_path, monkeypatch):
  """Issue 46 item 7: with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY set (as here) and no
  ~/.aws/ files, TensorStore is given the environment provider: no "Failed to open file
  ... .aws/config" nor "AuthCredentialsProvider" errors on stderr at a save or restore."""
  monkeypatch.setenv("HOME", str(tmp_path))  # No ~/.aws/ files, whoever runs the test.
  workdir = f"{s3_bucket}/run"
  _saved(workdir, steps=(1,))
  state, _ = _restore(checkpoint.make_manager(workdir, read_only=True), workdir)
  assert int(state.step) == 0
  err = capfd.readouterr().err
  assert "Failed to open file" not in err and "AuthCredentialsProvider" not in err, err[-2000:]


def test_the_seal_reads_nothing_back_from_the_bucket(s3_lossy):
  """Sealing a step takes the store's own checksums (a listing, HeadObjects) and writes
  CHECKSUMS.json: no object GET reaches the server (counted by the proxy in front of it);
  a bit flipped in the step afterwards is still found."""
  bucket, proxy = s3_lossy
  workdir = f"{bucket}/run"
  manager = checkpoint.make_manager(workdir, TRAIN)
  manager.save(1, args=checkpoint.save_args(_state(1.0), {"index": 1}))
  manager.wait_until_finished()
  gets = proxy.object_gets()
  checkpoint.seal(manager)
  manager.close()
  assert proxy.object_gets() == gets  # Listings and HEADs only.
  step_dir = f"{workdir}/checkpoints/1"
  assert storage.exists(f"{step_dir}/{CHECKSUMS_FILE}")
  checksums.verify(checkpoint.checkpoint_dir(workdir), 1)
  data_file = max((k for k in storage.files(step_dir) if "/d/" in k),
                  key=lambda k: storage.files(step_dir)[k])
  blob = bytearray(storage.read_bytes(f"{step_dir}/{data_file}"))
  blob[len(blob) // 3] ^= 0x01
  storage.write_bytes(f"{step_dir}/{data_file}", bytes(blob))
  with pytest.raises(CheckpointDamaged, match=f"{data_file} differs"):
    checksums.verify(checkpoint.checkpoint_dir(workdir), 1)

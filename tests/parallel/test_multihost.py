"""Two processes of 4 CPU devices train like one process of 8: they resume a
one-process checkpoint on their own mesh, take the same steps with the same
losses, write one log and save a checkpoint that both wrote. The processes are
real `launch.py` runs joined by jax.distributed on localhost (gloo collectives).
Slow (a minute or two per mesh on 2 cores), so marked: `make test-multihost`.
"""

import json
import os
import pathlib
import re

import jax
import numpy as np
import pytest

from experiments.configs import tiny
from train import load_run, loop
from train.lifecycle import changes as run_changes
from tests.parallel import two_processes
from train.metrics import read_metrics

REPO = two_processes.REPO
OVERRIDES = {
    "train.steps": 4, "train.log_every": 1, "train.checkpoint_every": 2,
    "train.schedule": "constant", "train.warmup_steps": 0, "train.async_checkpoint": False,
    "train.tensorboard": True, "eval.batches": 1,
    "mesh.data": 1, "mesh.fsdp": -1, "mesh.tensor": 1, "mesh.expert": 1,
}
# The two processes' meshes. fsdp: each process holds its own batch rows and half of
# every parameter. tensor: the tensor axis spans both processes, so they hold (and
# read) the same rows and split the heads / mlp / vocab dimensions between them.
TWO_PROCESS_MESHES = {
    "fsdp": {"mesh.fsdp": -1},
    "tensor": {"mesh.fsdp": 1, "mesh.tensor": -1},
}
# The one-process reference is fsdp=8; another mesh adds in another order (see
# test_train_equivalence.py for the tolerances).
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
PARAM_TOL = dict(rtol=1e-4, atol=2e-5)


def _config(**changes):
  c = tiny.get_config("smoke")
  for key, value in {**OVERRIDES, **changes}.items():
    section, field = key.split(".")
    c[section][field] = value
  return c


def _launch_two_processes(workdir: pathlib.Path, logdir: pathlib.Path,
                          mesh: dict) -> list[pathlib.Path]:
  flags = [f"--config.{k}={v}" for k, v in {**OVERRIDES, **mesh}.items()]
  return two_processes.run(
      lambda i, port: [str(REPO / "launch.py"),
                       "--config", str(REPO / "experiments/configs/tiny.py:smoke"),
                       "--workdir", str(workdir), *flags,
                       f"--coordinator_address=localhost:{port}",
                       "--num_processes=2", f"--process_id={i}"],
      logdir, timeout_s=300)


@pytest.mark.multihost
@pytest.mark.parametrize("mesh", list(TWO_PROCESS_MESHES))
def test_two_processes_resume_and_train_like_one(mesh, tmp_path):
  multi, single = tmp_path / "two_processes", tmp_path / "one_process"
  # Steps 1-2 in this process (8 devices), then the two processes restore step 2
  # onto their mesh (each reads its shards), take steps 3-4 and save step 4.
  loop.run(_config(**{"train.steps": 2, "train.tensorboard": False}), str(multi))
  loop.run(_config(**{"train.tensorboard": False}), str(single))
  logs = _launch_two_processes(multi, tmp_path, TWO_PROCESS_MESHES[mesh])
  progress = [re.findall(r"^step +(\d+)/4", log.read_text(), re.M) for log in logs]
  assert progress == [["3", "4"], []]  # Resumed at step 3; only process 0 reports.

  records = read_metrics(multi)
  train = [r for r in records if r["split"] == "train"]
  assert [r["step"] for r in train] == [1, 2, 3, 4]  # 3 and 4 written once: process 0 only.
  assert [r["step"] for r in records if r["split"] == "eval"] == [2, 4]
  # One events file of scalars and one of final hparams, not one each per process.
  events = sorted(str(f.parent.relative_to(multi)) for f in multi.rglob("events.out.tfevents*"))
  assert events == ["tensorboard", "tensorboard/hparams"], events
  # config.json's `_run` is the run's start (one process); the resume records the change.
  run_info = json.loads((multi / "config.json").read_text())["_run"]
  assert (run_info["process_count"], run_info["device_count"]) == (1, 8)
  changes = {c["field"]: c for c in run_changes.read_changes(multi)}
  assert {k: changes["_run.process_count"][k] for k in ("step", "old", "new")} == {
      "step": 2, "old": 1, "new": 2}

  want = [r for r in read_metrics(single) if r["split"] == "train"]
  for key in ("loss", "grad_norm", "param_norm"):
    np.testing.assert_allclose([r[key] for r in train], [r[key] for r in want], **LOSS_TOL,
                               err_msg=f"two processes ({mesh}) vs one: {key} per step")

  # Parameters are split across the processes: step 4 only restores (and matches)
  # if both processes wrote their shards.
  assert sorted(int(s) for s in os.listdir(multi / "checkpoints")) == [2, 4]
  assert load_run(str(multi)).step == 4
  got_params, want_params = (load_run(str(d)).variables["params"] for d in (multi, single))
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got_params),
                          jax.tree.leaves(want_params)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), **PARAM_TOL,
                               err_msg=f"two processes ({mesh}) vs one: "
                               f"{jax.tree_util.keystr(path)}")


@pytest.mark.multihost
def test_two_processes_write_their_shards_of_one_bucket_checkpoint(s3_bucket, tmp_path):
  """Into s3:// (moto, tests/storage_servers.py): each process writes its own OCDBT shard
  files of the step, process 0 alone the run's records and the commit marker."""
  from train import checkpoint  # pylint: disable=g-import-not-at-top
  from train.io import storage  # pylint: disable=g-import-not-at-top
  run = f"{s3_bucket}/run"
  loop.run(_config(**{"train.steps": 2, "train.tensorboard": False}), run)
  _launch_two_processes(run, tmp_path, TWO_PROCESS_MESHES["fsdp"])
  assert [r["step"] for r in read_metrics(run) if r["split"] == "train"] == [1, 2, 3, 4]
  step_dir = storage.join(checkpoint.checkpoint_dir(run), "4")
  found = storage.files(step_dir)
  for process in (0, 1):
    assert any(k.startswith(f"state/ocdbt.process_{process}/d/") for k in found), sorted(found)
  assert {"commit_success.txt", "CHECKSUMS.json"} <= set(found)
  assert load_run(run).step == 4


# A host whose view of RUN/spikes.jsonl is stale (a cached listing, a segment not yet
# visible to it): injected into process 1 alone, before launch.py imports anything.
_STALE_SPIKES = """import train.spikes
train.spikes.read_spikes = lambda workdir: []
"""


@pytest.mark.multihost
def test_two_processes_agree_on_the_rollback_limit(tmp_path):
  """At train.on_spike="rollback"'s limit (spikes.MAX_ROLLBACKS rollbacks to checkpoint
  10 already recorded), both processes give up with the same SpikeError, although process
  1 reads no rollback at all: the count is process 0's. Before, process 1 rolled back
  into the restore's collectives while process 0 raised, and waited forever."""
  from train import spikes  # pylint: disable=g-import-not-at-top
  run = tmp_path / "run"
  run.mkdir()
  seen = {"step": 12, "to_step": 10, "skip_batches": 2, "action": "rolled back to step 10"}
  (run / spikes.SPIKES_FILE).write_text(
      "".join(json.dumps(seen) + "\n" for _ in range(spikes.MAX_ROLLBACKS)))
  stale = tmp_path / "stale"
  stale.mkdir()
  (stale / "sitecustomize.py").write_text(_STALE_SPIKES)
  env = two_processes.cpu_env(4)
  envs = [env, dict(env, PYTHONPATH=f"{stale}{os.pathsep}{env['PYTHONPATH']}")]
  # tests/train/test_spikes.py's recipe: the poisoned batch makes step 12 a spike.
  flags = {**OVERRIDES, "train.steps": 14, "train.checkpoint_every": 10, "train.lr": 0.01,
           "train.tensorboard": False, "train.eval_every": 100, "train.spike_window": 4,
           "train.spike_threshold": 1.3, "train.on_spike": "rollback",
           "data.test_poison": "(11, 1)"}
  logs = [tmp_path / f"process{i}.log" for i in range(2)]
  codes, hung = two_processes.attempt(
      lambda i, port: [str(REPO / "launch.py"),
                       "--config", str(REPO / "experiments/configs/tiny.py:smoke"),
                       "--workdir", str(run), *[f"--config.{k}={v}" for k, v in flags.items()],
                       f"--coordinator_address=localhost:{port}", "--num_processes=2",
                       f"--process_id={i}"],
      envs, logs, timeout_s=150)
  texts = [log.read_text() for log in logs]
  report = "\n".join(f"--- process {i} exited {c} ---\n{t[-3000:]}"
                     for i, (c, t) in enumerate(zip(codes, texts)))
  assert not hung, report
  assert all(c not in (0, None) for c in codes), report
  for text in texts:
    assert f"already rolled back to checkpoint 10 {spikes.MAX_ROLLBACKS} times" in text, report

"""Sharded training == one device, and resuming on another mesh == no interruption.

The mesh runs go through the real loop (`train.loop.run`: sharded init, jitted
step with shardings and donation, orbax checkpoints); the reference is the same
pure train step, jitted without any sharding on one device and fed the same
batches. A smoke-size float32 model, constant learning rate (so that a run cut
at step 2 and resumed with more steps has the same schedule), 4 steps.
"""

import shutil

import jax
import numpy as np
import pytest

from experiments.configs import tiny
from parallel import sharded_init
from train import load_run, loop
from train.data.pipeline import make_source
from train.metrics import read_metrics
from train.optim import make_optimizer
from train.state import init_state
from train.step import make_train_step
from train.spec import model_config

STEPS = 4
# name: mesh sizes (missing axes are 1); each product is the 8 test devices. Pure data
# parallelism has no case of its own: the data axis is in data2_fsdp2_tensor2.
MESHES = {
    "fsdp8": {"fsdp": 8},
    "data2_fsdp2_tensor2": {"data": 2, "fsdp": 2, "tensor": 2},
}
# float32, but sharded matmuls and reductions add in another order. Adam divides
# by the gradient's own scale, so a parameter with a near-zero gradient can move
# a few 1e-6 more or less; 2e-5 is under 1% of one step's lr (3e-3), and the
# largest differences seen are 3e-6.
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
PARAM_TOL = dict(rtol=1e-4, atol=2e-5)


def config(mesh, steps=STEPS):
  c = tiny.get_config("smoke")
  c.train.update(steps=steps, log_every=1, checkpoint_every=2, schedule="constant",
                 warmup_steps=0, async_checkpoint=False, tensorboard=False)
  c.eval.batches = 1
  c.mesh.update({axis: mesh.get(axis, 1) for axis in ("data", "fsdp", "tensor", "expert")})
  return c


def train_records(workdir):
  return [r for r in read_metrics(workdir) if r["split"] == "train"]


def params_of(workdir):
  return jax.tree.map(np.asarray, load_run(str(workdir)).variables["params"])


def one_device_run(c, steps):
  """The config's pure train step on one device, no mesh, fed the loop's batches:
  (per-step metrics on the host, final params)."""
  model_cfg = model_config(c)
  optimizer = make_optimizer(c.train)
  state, _ = sharded_init(lambda: init_state(model_cfg, optimizer, int(c.train.seed),
                                             int(c.data.seq_len)), mesh=None, rules=None)
  step = jax.jit(make_train_step(model_cfg, c.train, optimizer))
  batches = make_source(c.data, None).train_iterator(int(c.train.seed), c.data.batch_size,
                                                      c.data.seq_len)
  records = []
  for _ in range(steps):
    state, metrics = step(state, next(batches))
    records.append(jax.device_get(metrics))
  assert len({d for x in jax.tree.leaves(state) for d in x.devices()}) == 1  # Really one.
  return records, jax.tree.map(np.asarray, state.params)


@pytest.fixture(scope="module")
def reference():
  """One device, no mesh: per-step losses and grad norms, and the final params."""
  return one_device_run(config({}), STEPS)


@pytest.fixture(scope="module")
def mesh_runs(tmp_path_factory):
  """Runs each mesh at most once per module: name -> workdir of a STEPS-step run."""
  done = {}

  def get(name):
    if name not in done:
      workdir = tmp_path_factory.mktemp(name)
      loop.run(config(MESHES[name]), str(workdir))
      done[name] = workdir
    return done[name]

  return get


def assert_params_close(got, want, what):
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, **PARAM_TOL,
                               err_msg=f"{what}: {jax.tree_util.keystr(path)}")


@pytest.mark.parametrize("name", list(MESHES))
def test_sharded_training_matches_one_device(name, reference, mesh_runs):
  want_records, want_params = reference
  workdir = mesh_runs(name)
  got = train_records(workdir)
  assert [r["step"] for r in got] == list(range(1, STEPS + 1))
  for key in ("loss", "grad_norm", "param_norm"):
    np.testing.assert_allclose([r[key] for r in got], [float(w[key]) for w in want_records],
                               **LOSS_TOL, err_msg=f"mesh {name}: {key} per step")
  assert got[0]["loss"] > got[-1]["loss"] + 1e-3  # It trains, so the check has teeth.
  assert_params_close(params_of(workdir), want_params, f"mesh {name}")


def test_resume_on_another_mesh_matches_uninterrupted(mesh_runs, tmp_path):
  """The fsdp=8 run's step-2 checkpoint (its later ones removed) restored onto
  data=2 x fsdp=2 x tensor=2 (every parameter changes layout; a mesh compiled above, so
  no new compile) goes on to 4."""
  straight = mesh_runs("fsdp8")
  shutil.copytree(straight, tmp_path, dirs_exist_ok=True)
  shutil.rmtree(tmp_path / "checkpoints" / str(STEPS))
  assert load_run(str(tmp_path)).step == 2
  loop.run(config(MESHES["data2_fsdp2_tensor2"]), str(tmp_path))
  got, want = train_records(tmp_path), train_records(straight)
  assert [r["step"] for r in got] == list(range(1, STEPS + 1))  # 3 and 4 from the resume.
  for key in ("loss", "grad_norm", "param_norm"):
    np.testing.assert_allclose([r[key] for r in got], [r[key] for r in want], **LOSS_TOL,
                               err_msg=f"resumed on data2_fsdp2_tensor2: {key} per step")
  assert_params_close(params_of(tmp_path), params_of(straight), "resumed on data2_fsdp2_tensor2")

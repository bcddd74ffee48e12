"""The circular pipeline schedule (train.pipeline_repeats = R > 1) through launch.py on 8
devices: equal to no pipeline (with tensor, data or context parallelism inside the
stages); its checkpoints (saved in layer order from a state trained in pipeline order)
resume with R = 1 or without stages, and the other way round; refusals.

The model is tiny.py:smoke with 8 layers (S R = 4 or 8 chunks), float32, constant learning
rate, 4 steps with a checkpoint at 2, as tests/parallel/test_pipeline.py's GPipe tests.
"""

import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import ModelConfig, Transformer
from parallel import logical_rules, make_mesh, mesh_context, pipeline_circular
from tests.cli import launch
from tests.parallel.test_pipeline import (LOSS_TOL, STEPS, assert_trains_like,
                                          train_records)
from tests.parallel.test_train_equivalence import one_device_run
from train import load_run
from train.eval.mode import evaluate_run
from train.metrics import read_metrics

# name: (mesh sizes, pipeline microbatches, repeats); the batch of 8 rows divides into
# microbatches x data-parallel size. stage2_r2 runs two groups of S microbatches.
MESHES = {
    "stage2_r2": ({"stage": 2, "fsdp": 2, "tensor": 2}, 4, 2),
    "stage4_r2": ({"stage": 4, "data": 2}, 4, 2),
    "stage2_r1": ({"stage": 2, "fsdp": 2, "tensor": 2}, 4, 1),
    "stage2_r2_context2": ({"stage": 2, "context": 2, "fsdp": 2}, 4, 2),  # Ring attention.
    "data8": ({"data": 8}, 0, 1),
}


def flags(mesh, microbatches, repeats, steps=STEPS):
  return ("--config.model.num_layers=8", f"--config.train.steps={steps}",
          "--config.train.log_every=1", "--config.train.schedule=constant",
          "--config.train.warmup_steps=0", "--config.train.checkpoint_every=2",
          "--config.train.async_checkpoint=False", "--config.train.tensorboard=False",
          "--config.train.telemetry=False", "--config.eval.batches=1",
          f"--config.train.pipeline_microbatches={microbatches}",
          f"--config.train.pipeline_repeats={repeats}",
          *(f"--config.mesh.{axis}={mesh.get(axis, 1)}"
            for axis in ("stage", "data", "fsdp", "tensor", "context")))


def assert_records_close(got, want, what):
  assert [r["step"] for r in got] == list(range(1, STEPS + 1)), what
  for key in ("loss", "grad_norm", "param_norm"):
    np.testing.assert_allclose([r[key] for r in got], [float(w[key]) for w in want],
                               **LOSS_TOL, err_msg=f"{what}: {key} per step")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """mesh name -> workdir of a STEPS-step launch.py run, each run at most once."""
  done = {}

  def get(name):
    if name not in done:
      workdir = tmp_path_factory.mktemp(name)
      launch("--workdir", str(workdir), *flags(*MESHES[name]))
      done[name] = workdir
    return done[name]

  return get


@pytest.mark.parametrize("name", ["stage2_r2", "stage4_r2", "stage2_r2_context2"])
def test_circular_training_matches_one_device(name, runs):
  """Loss, gradient and parameter norms per step, and the final (saved) parameters, equal
  to the same config's train step on one device: the schedule is right, and the state's
  pipeline order is undone for the checkpoint."""
  workdir = runs(name)
  run = load_run(str(workdir))
  assert run.config.train.pipeline_repeats == 2
  assert_trains_like(workdir, run, *one_device_run(run.config, STEPS), f"mesh {name}")


def _resume(straight, tmp_path, name):
  shutil.copytree(straight, tmp_path, dirs_exist_ok=True)
  shutil.rmtree(tmp_path / "checkpoints" / str(STEPS))
  assert load_run(str(tmp_path)).step == 2
  launch("--workdir", str(tmp_path), *flags(*MESHES[name]))
  return train_records(tmp_path)


@pytest.mark.parametrize("saved_on, resume_on", [
    ("stage2_r2", "stage2_r1"), ("stage2_r2", "data8"), ("data8", "stage2_r2")])
def test_a_checkpoint_resumes_with_other_repeats(saved_on, resume_on, runs, tmp_path):
  """A step-2 checkpoint saved with R = 2 resumed with GPipe (R = 1) or without stages, and
  one saved without stages resumed with R = 2: the uninterrupted run's numbers."""
  straight = runs(saved_on)
  got = _resume(straight, tmp_path, resume_on)
  assert_records_close(got, train_records(straight), f"{saved_on} resumed on {resume_on}")


def test_a_resume_with_the_same_repeats_is_bitwise(runs, tmp_path):
  """The R = 2 run's step-2 checkpoint resumed on the same mesh and R: bitwise the same
  losses, gradient and parameter norms (layer order -> pipeline order is a pure move)."""
  straight = runs("stage4_r2")
  got, want = _resume(straight, tmp_path, "stage4_r2"), train_records(straight)
  for key in ("loss", "grad_norm", "param_norm"):
    assert [r[key] for r in got] == [r[key] for r in want], key


def test_the_local_tier_saves_in_layer_order(runs, tmp_path):
  """The local checkpoint tier's save from an R = 2 trainer (step 3, newer than the
  persistent step 2 once step 4 is gone) resumes without stages: the uninterrupted run."""
  run, local = tmp_path / "run", tmp_path / "local"
  tier = ("--config.train.local_checkpoint_every=1", f"--config.train.local_checkpoint_dir={local}")
  launch("--workdir", str(run), *flags(*MESHES["stage4_r2"]), *tier)
  shutil.rmtree(run / "checkpoints" / str(STEPS))
  launch("--workdir", str(run), *flags(*MESHES["data8"]), *tier)
  got = train_records(run)
  assert_records_close(got, train_records(runs("stage4_r2")), "resumed from the local tier")


def test_evaluation_reads_each_layout_with_its_schedule(runs, tmp_path):
  """The loop's eval (the trainer's state, pipeline order, the circular schedule) and
  --mode eval of the saved checkpoint (layer order, GPipe) agree with each other and with
  the run without stages: the Evaluator is told which order it is handed."""
  circ, flat = runs("stage2_r2"), runs("data8")
  evals = lambda w: {r["step"]: r["loss"] for r in read_metrics(w) if r["split"] == "eval"}
  in_loop = evals(circ)[STEPS]
  np.testing.assert_allclose(in_loop, evals(flat)[STEPS], **LOSS_TOL)
  shutil.copytree(circ, tmp_path, dirs_exist_ok=True)
  np.testing.assert_allclose(evaluate_run(str(tmp_path))["loss"], in_loop, **LOSS_TOL)


def test_circular_equals_the_layers_in_sequence():
  """parallel.pipeline_circular alone: 2 stages x 3 repeats x 1 layer over 4 microbatches
  (two groups), forward and gradients equal to the 6 layers in order; the pipeline order
  puts chunk r S + s at stage s's local block r."""
  mesh = make_mesh({"stage": 2, "data": 4})
  k1, k2 = jax.random.split(jax.random.key(0))
  w_nDD = jax.random.normal(k1, (6, 16, 16)) / 4
  x_MbD = jax.random.normal(k2, (4, 4, 16))
  shift_Mb = jnp.arange(16.0).reshape(4, 4)

  def layers(w, x, shift):
    for i in range(w.shape[0]):
      x = jnp.tanh(x @ w[i]) + shift[:, None]
    return x

  def loss_seq(w, x):
    return jnp.sum(jnp.sin(jax.vmap(layers, (None, 0, 0))(w, x, shift_Mb)))

  def loss_pipe(w, x):
    out, aux = pipeline_circular.circular(lambda p, xb, sh, k: (layers(p, xb, sh), {}), w, x,
                                          shift_Mb, repeats=3)
    assert aux == {}
    return jnp.sum(jnp.sin(out))

  want = jax.jit(jax.value_and_grad(loss_seq, argnums=(0, 1)))(w_nDD, x_MbD)
  w_pipe = pipeline_circular.to_pipeline_order(w_nDD, 2, 3)
  for p, c in enumerate((0, 2, 4, 1, 3, 5)):  # Stage 0: chunks 0, S, 2S; stage 1: 1, 3, 5.
    np.testing.assert_array_equal(w_pipe[p], w_nDD[c])
  with jax.set_mesh(mesh):
    (loss, (g_w, g_x)) = jax.jit(jax.value_and_grad(loss_pipe, argnums=(0, 1)))(w_pipe, x_MbD)
  np.testing.assert_allclose(loss, want[0], rtol=1e-5)
  np.testing.assert_allclose(pipeline_circular.to_layer_order(g_w, 2, 3), want[1][0],
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(g_x, want[1][1], rtol=1e-5, atol=1e-5)
  assert pipeline_circular.bubble_fraction(2, 4, 3) == 1 / 13


@pytest.mark.parametrize("dtype, tol, inside", [
    ("float32", 2e-6, "tensor"), ("bfloat16", 2e-2, "tensor"), ("float32", 2e-6, "context")])
def test_transformer_circular_with_tensor_inside_equals_no_mesh(dtype, tol, inside):
  """Transformer with pipeline_repeats=2 on (stage=2, data=2, tensor=2) or (stage=2,
  data=2, context=2: the ring attention inside the stages), a layer pattern (period 2: one
  period per chunk), 4 microbatches, its stack in pipeline order: hidden states and loss
  gradients (back in layer order) equal those without a mesh."""
  cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=8, num_heads=4, num_kv_heads=2,
                    mlp_dim=64, max_seq_len=16, pos_encoding="rope", dtype=dtype,
                    attention_pattern=("local", "global"), sliding_window=4)
  tokens_BL = jax.random.randint(jax.random.key(1), (16, 16), 0, 64)
  net = Transformer(cfg)
  params = nn.unbox(net.init(jax.random.key(0), tokens_BL))["params"]
  order = lambda f, p: {**p, "layers": jax.tree.map(lambda x: f(x, 2, 2), p["layers"])}

  def loss(p, repeats):
    h = net.apply({"params": p}, tokens_BL, return_hidden=True, pipeline_microbatches=4,
                  pipeline_repeats=repeats)
    return jnp.mean(jnp.sin(h.astype(jnp.float32) * 3)), h

  (_, want_h), want_g = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(
      params, 1)
  mesh = make_mesh({"stage": 2, "data": 2, inside: 2})
  with mesh_context(mesh, logical_rules(mesh=mesh, num_kv_heads=2, num_heads=4)):
    (_, got_h), got_g = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(
        order(pipeline_circular.to_pipeline_order, params), 2)
  got_g = order(pipeline_circular.to_layer_order, got_g)
  np.testing.assert_allclose(np.asarray(got_h, np.float32), np.asarray(want_h, np.float32),
                             atol=tol, rtol=tol)
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got_g), jax.tree.leaves(want_g)):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               atol=tol * 1e-1, rtol=tol * 10, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("args, words", [
    (("--config.train.pipeline_microbatches=2",),
     ["train.pipeline_microbatches=2", "microbatches (2) must be a multiple of mesh.stage (4)"]),
    (("--config.model.num_layers=4",), ["model.num_layers=4", "8 chunks", "divisible by 8"]),
    (("--config.model.attention_pattern=('local', 'global')",
      "--config.model.sliding_window=8"), ["whole periods", "period 2", "divisible by 8"]),
    (("--config.train.pipeline_repeats=0",), ["train.pipeline_repeats=0", ">= 1"]),
    (("--config.train.optimizer=kron",), ["train.optimizer='kron'", "preconditioners"]),
    (("--config.mesh.stage=1", "--config.mesh.data=8", "--config.train.pipeline_microbatches=0"),
     ["train.pipeline_repeats=2", "only with mesh.stage > 1"]),
])
def test_what_the_circular_schedule_cannot_run_is_refused_by_name(args, words, tmp_path):
  base = flags({"stage": 4, "data": 2}, 4, 2)
  with pytest.raises(ValueError) as err:
    launch("--workdir", str(tmp_path / "r"), *base, *args)
  for word in words:
    assert word in str(err.value), (word, str(err.value))
  assert not (tmp_path / "r").exists()

"""Pipeline parallelism (mesh.stage): GPipe == no pipeline, through launch.py on 8 devices;
a checkpoint written with one stage count resumes with another (or none); refusals by name.

The model is tiny.py:smoke with 4 layers (so 4 stages hold one layer each), float32,
constant learning rate, 4 steps with a checkpoint at 2. The reference is the same config's
pure train step on one device without a mesh (tests/parallel/test_train_equivalence.py).
"""

import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import ModelConfig, Transformer
from parallel import logical_rules, make_mesh, mesh_context, pipeline
from experiments.configs import tiny
from tests.cli import launch
from tests.parallel.test_train_equivalence import one_device_run
from train import load_run
from train.lifecycle.session import open_run
from train.metrics import read_metrics
from train.spec import read
from train.step import jit_train_step


P = jax.sharding.PartitionSpec
STEPS = 4
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)  # As tests/parallel/test_train_equivalence.py.
PARAM_TOL = dict(rtol=1e-4, atol=2e-5)
# name: (mesh sizes, pipeline microbatches); each product is the 8 test devices, the
# batch of 8 rows divides into microbatches x data-parallel size.
MESHES = {
    "stage2_fsdp4": ({"stage": 2, "fsdp": 4}, 2),
    "stage4_data2": ({"stage": 4, "data": 2}, 4),
    "data8": ({"data": 8}, 0),
}


def flags(mesh, microbatches, steps=STEPS):
  return ("--config.model.num_layers=4", f"--config.train.steps={steps}",
          "--config.train.log_every=1", "--config.train.schedule=constant",
          "--config.train.warmup_steps=0", "--config.train.checkpoint_every=2",
          "--config.train.async_checkpoint=False", "--config.train.tensorboard=False",
          "--config.train.telemetry=False", "--config.eval.batches=1",
          f"--config.train.pipeline_microbatches={microbatches}",
          *(f"--config.mesh.{axis}={mesh.get(axis, 1)}"
            for axis in ("stage", "data", "fsdp", "tensor")))


def train_records(workdir):
  return [r for r in read_metrics(workdir) if r["split"] == "train"]


def assert_records_close(got, want, what, tol=LOSS_TOL):
  assert [r["step"] for r in got] == list(range(1, STEPS + 1))
  for key in ("loss", "grad_norm", "param_norm"):
    np.testing.assert_allclose([r[key] for r in got], [float(w[key]) for w in want], **tol,
                               err_msg=f"{what}: {key} per step")


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


@pytest.fixture(scope="module")
def reference(runs):
  """One device, no mesh, the same config: per-step metrics and final params."""
  return one_device_run(load_run(str(runs("stage2_fsdp4"))).config, STEPS)


@pytest.mark.parametrize("name", ["stage2_fsdp4", "stage4_data2"])
def test_pipelined_training_matches_one_device(name, runs, reference):
  workdir = runs(name)
  run = load_run(str(workdir))
  assert run.config.mesh.stage == MESHES[name][0]["stage"]
  assert_trains_like(workdir, run, *reference, f"mesh {name}")


def assert_trains_like(workdir, run, want_records, want_params, what):
  """The launched run's per-step records and final parameters equal the reference's."""
  got = train_records(workdir)
  assert_records_close(got, want_records, what)
  assert got[0]["loss"] > got[-1]["loss"] + 1e-3  # It trains, so the check has teeth.
  params = jax.tree.map(np.asarray, run.variables["params"])
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(params),
                          jax.tree.leaves(want_params)):
    np.testing.assert_allclose(g, w, **PARAM_TOL, err_msg=f"{what}: {jax.tree_util.keystr(path)}")
  return got


def _resume(straight, tmp_path, name):
  shutil.copytree(straight, tmp_path, dirs_exist_ok=True)
  shutil.rmtree(tmp_path / "checkpoints" / str(STEPS))
  assert load_run(str(tmp_path)).step == 2
  launch("--workdir", str(tmp_path), *flags(*MESHES[name]))
  return train_records(tmp_path)


@pytest.mark.parametrize("resume_on", ["stage4_data2", "data8"])
def test_a_stage2_checkpoint_resumes_on_another_stage_count(resume_on, runs, tmp_path):
  """The stage=2 run's step-2 checkpoint resumed with 4 stages, or none: the same run as
  the uninterrupted one (the layer stacks' layout changes; the sums' order too)."""
  straight = runs("stage2_fsdp4")
  got = _resume(straight, tmp_path, resume_on)
  assert_records_close(got, train_records(straight), f"resumed on {resume_on}")


def test_a_resume_on_the_same_stages_is_bitwise(runs, tmp_path):
  """The stage=4 run's step-2 checkpoint resumed on the same mesh: bitwise the same
  losses, gradient and parameter norms after the restore."""
  straight = runs("stage4_data2")
  got, want = _resume(straight, tmp_path, "stage4_data2"), train_records(straight)
  for key in ("loss", "grad_norm", "param_norm"):
    assert [r[key] for r in got] == [r[key] for r in want], key


def test_the_launched_step_cuts_the_layers_and_permutes_between_stages(runs):
  """The run's layout: the stacked layers (and their Adam moments) split over "stage",
  the embedding not; its train step, lowered as the loop jits it, holds the pipeline's
  collective permutes (forward and their transpose)."""
  config = load_run(str(runs("stage2_fsdp4"))).config
  lay = open_run(config, None, "compile")
  for tree in (lay.shardings.params, lay.shardings.opt_state):
    specs = {jax.tree_util.keystr(p): s.spec for p, s in
             jax.tree_util.tree_leaves_with_path(tree) if hasattr(s, "spec")}
    assert all(spec[0] == "stage" for k, spec in specs.items() if "['layers']" in k), specs
    assert all(not spec or spec[0] != "stage" for k, spec in specs.items()
               if "['layers']" not in k), specs
  B, L = config.data.batch_size, config.data.seq_len
  batch = {k: jax.ShapeDtypeStruct((B, L), jnp.float32 if k == "weights" else jnp.int32,
                                    sharding=lay.batch_sharding)
           for k in ("inputs", "targets", "positions", "segment_ids", "weights")}
  step = jit_train_step(lay.model_cfg, config.train, lay.optimizer, lay.shardings,
                        lay.batch_sharding)
  with mesh_context(lay.mesh, lay.rules):
    text = step.lower(lay.template, batch).as_text()
  assert text.count("collective_permute") >= 2, "no stage-to-stage transfer in the step"


@pytest.mark.parametrize("dtype, tol, impl", [("float32", 2e-6, "xla"),
                                             ("bfloat16", 2e-2, "xla"),
                                             ("float32", 2e-6, "blockwise")])
def test_transformer_on_stages_with_tensor_inside_equals_no_mesh(dtype, tol, impl):
  """Transformer's hidden states and loss gradients on (stage=2, data=2, tensor=2), a layer
  pattern (period 2, one period per stage), 4 microbatches, equal those without a mesh;
  blockwise attention too (its loop carries typed as varying over the stage, or it does
  not trace inside one)."""
  cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=4, num_heads=4, num_kv_heads=2,
                    mlp_dim=64, max_seq_len=16, pos_encoding="rope", dtype=dtype,
                    attention_pattern=("local", "global"), sliding_window=4,
                    attention_impl=impl, attention_block_q=8, attention_block_kv=8)
  tokens_BL = jax.random.randint(jax.random.key(1), (16, 16), 0, 64)
  net = Transformer(cfg)
  params = nn.unbox(net.init(jax.random.key(0), tokens_BL))["params"]

  def loss(p):
    h = net.apply({"params": p}, tokens_BL, return_hidden=True, pipeline_microbatches=4)
    return jnp.mean(jnp.sin(h.astype(jnp.float32) * 3)), h

  fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
  (_, want_h), want_g = fn(params)
  mesh = make_mesh({"stage": 2, "data": 2, "tensor": 2})
  with mesh_context(mesh, logical_rules(mesh=mesh, num_kv_heads=2, num_heads=4)):
    text = fn.lower(params).as_text()
    (_, got_h), got_g = fn(params)
  assert "collective_permute" in text
  np.testing.assert_allclose(np.asarray(got_h, np.float32), np.asarray(want_h, np.float32),
                             atol=tol, rtol=tol)
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got_g), jax.tree.leaves(want_g)):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               atol=tol * 1e-1, rtol=tol * 10, err_msg=jax.tree_util.keystr(path))


def test_gpipe_equals_the_layers_in_sequence():
  """parallel.pipeline.gpipe alone: 4 stages x 2 layers over 6 microbatches, forward and
  gradients (params and input) equal to applying the 8 layers in order, data=2 inside;
  each stage's aux (per layer: the mean square of its tanh) summed over its 6
  microbatches, bubble ticks left out, and differentiable like the output."""
  mesh = make_mesh({"stage": 4, "data": 2})
  k1, k2 = jax.random.split(jax.random.key(0))
  w_nDD = jax.random.normal(k1, (8, 16, 16)) / 4
  x_MbD = jax.random.normal(k2, (6, 4, 16))
  shift_Mb = jnp.arange(24.0).reshape(6, 4)

  def layers(w, x, shift):
    squares = []
    for i in range(w.shape[0]):
      h = jnp.tanh(x @ w[i])
      squares.append(jnp.mean(jnp.square(h)))
      x = h + shift[:, None]
    return x, {"sq": jnp.stack(squares)}

  def loss_seq(w, x):
    out, aux = jax.vmap(layers, (None, 0, 0))(w, x, shift_Mb)
    return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.cos(aux["sq"].sum(0))), aux["sq"].sum(0)

  def loss_pipe(w, x):
    out, aux = pipeline.gpipe(lambda p, xb, sh, k: layers(p, xb, sh), w, x, shift_Mb)
    assert aux["sq"].shape == (4, 2)  # [stages, layers per stage]
    sq = aux["sq"].reshape(8)
    return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.cos(sq)), sq

  want = jax.jit(jax.value_and_grad(loss_seq, argnums=(0, 1), has_aux=True))(w_nDD, x_MbD)
  with jax.set_mesh(mesh):
    got = jax.jit(jax.value_and_grad(loss_pipe, argnums=(0, 1), has_aux=True))(w_nDD, x_MbD)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
  assert pipeline.bubble_fraction(4, 6) == 3 / 9
  x_BD = jnp.arange(24.0).reshape(12, 2)
  assert (pipeline.from_microbatches(pipeline.to_microbatches(x_BD, 3)) == x_BD).all()


@pytest.mark.parametrize("args, words", [
    (("--config.model.num_layers=6",), ["model.num_layers=6", "4 equal contiguous stages"]),
    (("--config.model.attention_pattern=('local', 'global')",
      "--config.model.sliding_window=8"), ["whole periods", "period 2"]),
    (("--config.train.pipeline_microbatches=8",),
     ["data.batch_size=8", "train.pipeline_microbatches (8)", "= 16"]),
    (("--config.data.batch_size=4", "--config.train.pipeline_microbatches=2"),
     ["data.batch_size=4", "mesh.stage x data*fsdp*expert = 8", "head"]),
    (("--config.train.telemetry=True",), ["train.telemetry=True", "telemetry=False"]),
    (("--config.eval.tasks=passkey",), ["eval.tasks='passkey'", "task evaluation"]),
    (("--config.mesh.stage=1", "--config.mesh.data=8", "--config.train.pipeline_microbatches=2"),
     ["train.pipeline_microbatches=2", "only with mesh.stage > 1"]),
    (("--config.mesh.stage=1", "--config.mesh.data=8", "--config.train.pipeline_schedule=1f1b"),
     ["train.pipeline_schedule='1f1b'", "only with mesh.stage > 1"]),
    (("--config.train.pipeline_schedule=1f1b", "--config.train.pipeline_repeats=2",
      "--config.model.num_layers=8"), ["train.pipeline_repeats=2", "1F1B", "contiguous"]),
    (("--config.train.pipeline_schedule=1f1b", "--config.model.num_experts=4",
      "--config.model.load_balance=aux_loss"),
     ["model.load_balance='aux_loss'", "1F1B", "whole batch", "loss_free"]),
    (("--config.train.pipeline_schedule=1f1b", "--config.mesh.stage=2", "--config.mesh.data=1",
      "--config.mesh.fsdp=2", "--config.mesh.context=2"), ["mesh.context=2", "1F1B", "zig-zag"]),
    (("--config.train.pipeline_repeats=2", "--config.model.num_layers=16",
      "--config.model.num_experts=4", "--config.model.first_k_dense=4"),
     ["model.first_k_dense=4", "two circular pipelines", "divisible by 8"]),
    (("--config.model.num_experts=4", "--config.model.first_k_dense=1",
      "--config.mesh.stage=2", "--config.mesh.data=4"),
     ["model.first_k_dense=1", "two pipelines", "divisible by 2"]),
    (("--config.model.num_experts=4", "--config.model.moe_dispatch=expert_parallel",
      "--config.mesh.stage=2", "--config.mesh.data=2", "--config.mesh.expert=2"),
     ["model.moe_dispatch='expert_parallel'", "does not nest", "capacity_einsum"]),
    (("--config.train.pipeline_schedule=1f1b_lockstep", "--config.model.num_experts=4",
      "--config.model.load_balance=aux_loss"), ["model.load_balance='aux_loss'", "1F1B"]),
    (("--config.mesh.stage=1", "--config.mesh.data=8",
      "--config.train.pipeline_schedule=1f1b_lockstep"),
     ["train.pipeline_schedule='1f1b_lockstep'", "only with mesh.stage > 1"]),
    (("--config.train.pipeline_schedule=1f1b", "--config.train.pipeline_stash=1"),
     ["train.pipeline_stash=1", "only with train.pipeline_schedule='zero_bubble'"]),
    (("--config.train.pipeline_schedule=interleaved",),
     ["train.pipeline_schedule='interleaved'", "gpipe", "1f1b_lockstep", "zero_bubble"]),
])
def test_what_the_pipeline_cannot_run_is_refused_by_name(args, words, tmp_path):
  base = flags({"stage": 4, "data": 2}, 0)
  with pytest.raises(ValueError) as err:
    launch("--workdir", str(tmp_path / "r"), *base, *args)
  for word in words:
    assert word in str(err.value), (word, str(err.value))
  assert not (tmp_path / "r").exists()


def _head_flops_per_vocab(mesh_sizes, dtype):
  """d(per-device FLOPs of the launched config's compiled train step) / d(vocab_size):
  what the embedding lookup, head and loss cost each device per vocabulary entry, which
  scales with the rows each device computes them for."""
  flops = []
  for vocab in (256, 768):
    config = tiny.get_config("smoke")
    config.model.update(num_layers=4, vocab_size=vocab, dtype=dtype, loss_chunks="1")
    config.data.batch_size = 16
    config.mesh.update(**{a: mesh_sizes.get(a, 1) for a in ("stage", "data", "fsdp")})
    config.train.update(telemetry=False, pipeline_microbatches=2 if "stage" in mesh_sizes
                        else 0)
    lay = open_run(read(config), None, "compile")
    B, L = config.data.batch_size, config.data.seq_len
    batch = {k: jax.ShapeDtypeStruct((B, L), jnp.float32 if k == "weights" else jnp.int32,
                                      sharding=lay.batch_sharding)
             for k in ("inputs", "targets", "positions", "segment_ids", "weights")}
    step = jit_train_step(lay.model_cfg, config.train, lay.optimizer, lay.shardings,
                          lay.batch_sharding)
    with mesh_context(lay.mesh, lay.rules):
      flops.append(step.lower(lay.template, batch).compile().cost_analysis()["flops"])
  return (flops[1] - flops[0]) / 512


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_head_runs_data_parallel_over_the_stages(dtype):
  """Outside the schedule the batch is split over the stage axis too: on (stage=2, fsdp=4)
  each device's embedding, head and loss cost what they cost on (data=2, fsdp=4), rows
  B / 8 each, not twice that (the head replicated over the stages, as before)."""
  piped = _head_flops_per_vocab({"stage": 2, "fsdp": 4}, dtype)
  flat = _head_flops_per_vocab({"data": 2, "fsdp": 4}, dtype)
  assert flat > 0 and abs(piped / flat - 1) < 0.1, (piped, flat)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpipe_gathers_its_input_and_scatters_its_output_over_the_stages(dtype):
  """Under the rules table (stage=4, data=2: "batch" -> ("data", "stage")) the rows outside
  the schedule are split over the stages: gpipe's output leaves it split so (each device
  b / 8 rows), by collective permutes from the last stage, no all-to-all or all-gather;
  forward and gradients equal the layers in sequence; a sharding constraint naming
  "batch" inside a stage traces (the rules there do not name the manual stage axis)."""
  mesh = make_mesh({"stage": 4, "data": 2})
  k1, k2 = jax.random.split(jax.random.key(0))
  w_nDD = (jax.random.normal(k1, (4, 16, 16)) / 4).astype(dtype)
  x_MbD = jax.random.normal(k2, (2, 16, 16)).astype(dtype)

  def layers(w, x):
    for i in range(w.shape[0]):
      x = nn.with_logical_constraint(jnp.tanh(x @ w[i]), ("batch", "embed"))
    return x

  def loss_seq(w, x):
    return jnp.sum(jnp.sin(jax.vmap(layers, (None, 0))(w, x).astype(jnp.float32))), x

  def loss_pipe(w, x):
    out = pipeline.gpipe(lambda p, xb, e, k: (layers(p, xb), {}), w, x)[0]
    out = nn.with_logical_constraint(out, (None, "batch", "embed"))
    return jnp.sum(jnp.sin(out.astype(jnp.float32))), out

  want = jax.jit(jax.value_and_grad(loss_seq, argnums=(0, 1), has_aux=True))(w_nDD, x_MbD)
  fn = jax.jit(jax.value_and_grad(loss_pipe, argnums=(0, 1), has_aux=True))
  with mesh_context(mesh, logical_rules(mesh=mesh)):
    text = fn.lower(w_nDD, x_MbD).compile().as_text()
    (loss, out), grads = fn(w_nDD, x_MbD)
  assert out.sharding.spec[1] == ("data", "stage"), out.sharding
  assert out.addressable_shards[0].data.shape == (2, 2, 16)
  assert "all-to-all" not in text and "all-gather" not in text
  assert text.count("collective-permute") >= 2 * 3 + 2  # Gather, scatter, the ticks.
  tol = 1e-5 if dtype == "float32" else 2e-2
  np.testing.assert_allclose(np.float32(loss), np.float32(want[0][0]), rtol=tol)
  for g, w in zip(grads, want[1]):
    np.testing.assert_allclose(np.float32(g), np.float32(w), rtol=tol, atol=tol)

"""The 1F1B schedules (parallel/pipeline_1f1b.py, parallel/pipeline_1f1b_lockstep.py,
parallel/pipeline_zero_bubble.py):
equal to the unpipelined loss and gradients, alone and through launch.py, and their
residual rings bounded by min(M, S) and min(M, 2S - 1) microbatches where GPipe's memory
grows with M."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallel import make_mesh, pipeline
from parallel.pipeline_1f1b import one_f_one_b, ring_slots
from parallel.pipeline_1f1b_lockstep import ring_slots as lockstep_slots


def _layers(w, x, shift):
  for i in range(w.shape[0]):
    x = jnp.tanh(x @ w[i]) + shift[:, None]
  return x


def _tail(v, y, target):
  """A head: per-microbatch loss and stats (max, which a sum would get wrong)."""
  out = jnp.sum(jnp.sin(y @ v) * target)
  return out, {"sum": out, "max": jnp.max(y)}


# The lockstep and zero-bubble schedules' cases run in the slow tier (make test's 10-minute
# budget; zero bubble's own aux and remat tests below run in it).
@pytest.mark.parametrize("schedule, stash", [
    ("1f1b", 0), *(pytest.param(*case, marks=pytest.mark.slow) for case in (
        ("1f1b_lockstep", 0), ("zero_bubble", 0), ("zero_bubble", 1)))])
@pytest.mark.parametrize("stages, microbatches, dtype, tol", [
    (4, 6, jnp.float32, 1e-5), (2, 2, jnp.float32, 1e-5), (4, 9, jnp.float32, 1e-5),
    (2, 5, jnp.bfloat16, 2e-2), (4, 3, jnp.bfloat16, 2e-2)])
def test_1f1b_equals_the_layers_and_tail_in_sequence(stages, microbatches, dtype, tol,
                                                     schedule, stash):
  """4 or 2 stages, M below, at and above S and 2S - 1 (the rings wrap): loss, stats and the
  gradients of the stack, the tail and the input equal the unpipelined ones, data inside;
  in bfloat16 within its rounding."""
  mesh = make_mesh({"stage": stages, "data": 8 // stages})
  k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
  w_nDD = jax.random.normal(k1, (8, 16, 16)) / 4
  v_DD = jax.random.normal(k2, (16, 16)) / 4
  x_MbD = jax.random.normal(k3, (microbatches, 4, 16))
  target_MbD = jax.random.normal(k4, (microbatches, 4, 16))
  shift_Mb = jnp.arange(microbatches * 4.0).reshape(microbatches, 4) / 10
  w_nDD, v_DD, x_MbD, target_MbD, shift_Mb = (
      a.astype(dtype) for a in (w_nDD, v_DD, x_MbD, target_MbD, shift_Mb))

  def loss_seq(w, v, x):
    y = jax.vmap(_layers, (None, 0, 0))(w, x, shift_Mb)
    loss, stats = jax.vmap(_tail, (None, 0, 0))(v, y, target_MbD)
    return jnp.sum(loss), stats

  def loss_pipe(w, v, x):
    return one_f_one_b(lambda p, xb, sh, k: (_layers(p, xb, sh), {}), _tail, w, v, x,
                       shift_Mb, target_MbD, schedule=schedule, stash=stash)[:2]

  grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))
  want = grad(loss_seq)(w_nDD, v_DD, x_MbD)
  with jax.set_mesh(mesh):
    got = grad(loss_pipe)(w_nDD, v_DD, x_MbD)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == w.dtype
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               rtol=tol, atol=tol * np.abs(np.asarray(w, np.float32)).max())


@pytest.mark.parametrize("schedule", ["1f1b", "1f1b_lockstep", "zero_bubble"])
def test_1f1b_differentiates_each_stages_own_loss_terms_and_sums_its_aux(schedule):
  """A stage's aux (each layer's mean square activation, as an MoE layer sows its losses)
  summed over its microbatches leaves the schedule stacked over the stages, and its own
  loss term (aux_loss_fn: 0.3 x that aux / M) is in the loss and differentiated in the
  stage's backwards: loss, aux and every gradient equal the layers in sequence with the
  same terms, 2 stages of 4 layers, M = 6 (the rings wrap)."""
  S, M = 2, 6
  mesh = make_mesh({"stage": S, "data": 4})
  k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
  w_nDD = jax.random.normal(k1, (8, 16, 16)) / 4
  v_DD = jax.random.normal(k2, (16, 16)) / 4
  x_MbD = jax.random.normal(k3, (M, 4, 16))
  target_MbD = jax.random.normal(k4, (M, 4, 16))

  def layers(w, x):  # (y, {"sq": [layers]}): each layer's mean square output.
    sq = []
    for i in range(w.shape[0]):
      x = jnp.tanh(x @ w[i])
      sq.append(jnp.mean(jnp.square(x)))
    return x, {"sq": jnp.stack(sq)}

  def loss_seq(w, v, x):
    y, aux = jax.vmap(layers, (None, 0))(w, x)
    loss = jnp.sum(jax.vmap(lambda y, t: _tail(v, y, t)[0])(y, target_MbD))
    sq_n = aux["sq"].sum(0)
    return loss + 0.3 * jnp.sum(sq_n) / M, sq_n

  def loss_pipe(w, v, x):
    loss, _, aux_S = one_f_one_b(lambda p, xb, _, k: layers(p, xb), _tail, w, v, x, None,
                                 target_MbD, schedule=schedule,
                                 aux_loss_fn=lambda aux: 0.3 * jnp.sum(aux["sq"]) / M)
    return loss, aux_S["sq"].reshape(-1)  # [S, 4] -> [8]: the layers in order.

  grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))
  (want_loss, want_sq), want_g = grad(loss_seq)(w_nDD, v_DD, x_MbD)
  with jax.set_mesh(mesh):
    (got_loss, got_sq), got_g = grad(loss_pipe)(w_nDD, v_DD, x_MbD)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
  np.testing.assert_allclose(got_sq, want_sq, rtol=1e-5)
  without = jax.jit(jax.grad(lambda w: loss_seq(w, v_DD, x_MbD)[0] - 0.3 * jnp.sum(
      loss_seq(w, v_DD, x_MbD)[1]) / M))(w_nDD)
  assert np.abs(np.asarray(without - want_g[0])).max() > 1e-3  # The term moves gradients.
  for g, w in zip(got_g, want_g):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(np.asarray(w)).max())


@jax.checkpoint
def _rematted_layer(w, x):
  """tanh(x w) scaled by a constant (as RoPE's frequencies under a remat policy): the
  layer's residuals include a value of no input's, not varying over the stages."""
  return jnp.tanh(x @ w) * jnp.cos(jnp.asarray(np.arange(x.shape[-1]) / 8, x.dtype))[None]


@pytest.mark.parametrize("schedule", ["1f1b", "1f1b_lockstep", "zero_bubble"])
def test_1f1b_keeps_a_rematted_layers_constant_residual(schedule):
  """A residual that no input varies (the 1b preset's, compiled by libtpu, failed so:
  the switch's branches returned it typed otherwise than the ring) is kept once and used
  in every backward: the gradients equal the layers' in sequence."""
  mesh = make_mesh({"stage": 2, "data": 4})
  k1, k2, k3, k4 = jax.random.split(jax.random.key(1), 4)
  w_nDD, v_DD = jax.random.normal(k1, (4, 16, 16)) / 4, jax.random.normal(k2, (16, 16)) / 4
  x_MbD, target_MbD = jax.random.normal(k3, (3, 4, 16)), jax.random.normal(k4, (3, 4, 16))

  def layers(w, x):
    for i in range(w.shape[0]):
      x = _rematted_layer(w[i], x)
    return x

  def loss_seq(w, v, x):
    return jnp.sum(jax.vmap(lambda x, t: _tail(v, layers(w, x), t)[0])(x, target_MbD))

  def loss_pipe(w, v, x):
    return one_f_one_b(lambda p, xb, _, k: (layers(p, xb), {}), _tail, w, v, x, None,
                       target_MbD, schedule=schedule)[0]

  grad = lambda f: jax.jit(jax.grad(f, argnums=(0, 1, 2)))
  want = grad(loss_seq)(w_nDD, v_DD, x_MbD)
  with jax.set_mesh(mesh):
    got = grad(loss_pipe)(w_nDD, v_DD, x_MbD)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(np.asarray(w)).max())


# (mesh sizes, microbatches): (stage=2, tensor=4) at M = 8 > 2S - 1, so the residual rings
# wrap; (stage=4, data=2) at M = S; (stage=2, fsdp=2, tensor=2) at M = 2S, where XLA aborted
# (the loss's gather of vocabulary-split logits) or deadlocked (the norms' scales moved
# from fsdp to tensor by a collective-permute inside the schedule's switch) before.
LAUNCHED = {"stage2_tensor4_m8": ({"stage": 2, "tensor": 4}, 8),
            "stage4_data2_m4": ({"stage": 4, "data": 2}, 4),
            "stage2_fsdp2_tensor2_m4": ({"stage": 2, "fsdp": 2, "tensor": 2}, 4)}


@pytest.fixture(scope="module")
def reference_1f1b(tmp_path_factory):
  """The one-device reference of tests/parallel/test_pipeline.py's config, and a GPipe run
  (stage=2, tensor=4, M=8) to compare with bitwise-near."""
  from tests.cli import launch
  from tests.parallel.test_pipeline import STEPS, flags
  from tests.parallel.test_train_equivalence import one_device_run
  from train import load_run
  workdir = tmp_path_factory.mktemp("gpipe")
  launch("--workdir", str(workdir), *flags(*LAUNCHED["stage2_tensor4_m8"]))
  return one_device_run(load_run(str(workdir)).config, STEPS), workdir


@pytest.mark.parametrize("schedule", ["1f1b", "1f1b_lockstep", "zero_bubble"])
@pytest.mark.parametrize("name", list(LAUNCHED))
def test_1f1b_training_through_launch_matches_one_device_and_gpipe(name, schedule,
                                                                   reference_1f1b, tmp_path):
  """launch.py with train.pipeline_schedule=1f1b (or 1f1b_lockstep) trains like one device
  (loss, gradient norm, parameter norm per step; final parameters) and like GPipe."""
  from tests.cli import launch
  from tests.parallel.test_pipeline import (assert_records_close, assert_trains_like, flags,
                                            train_records)
  from train import load_run
  reference, gpipe_dir = reference_1f1b
  launch("--workdir", str(tmp_path), *flags(*LAUNCHED[name]),
         f"--config.train.pipeline_schedule={schedule}")
  run = load_run(str(tmp_path))
  assert run.config.train.pipeline_schedule == schedule
  got = assert_trains_like(tmp_path, run, *reference, f"{schedule} on {name}")
  assert_records_close(got, train_records(gpipe_dir), f"{schedule} on {name} vs gpipe")


def test_zero_bubble_with_remat_trains_like_one_device(reference_1f1b, tmp_path):
  """model.remat='full' (the pod presets' policy) with the zero-bubble schedule on
  (stage=2, fsdp=2, tensor=2, M=4) and a stash of 1 (train.pipeline_stash): B recomputes
  each layer and W reads what it recomputed (parallel/backward_split.py); trains like one
  device and like GPipe."""
  from tests.cli import launch
  from tests.parallel.test_pipeline import (assert_records_close, assert_trains_like, flags,
                                            train_records)
  from train import load_run
  reference, gpipe_dir = reference_1f1b
  launch("--workdir", str(tmp_path), *flags(*LAUNCHED["stage2_fsdp2_tensor2_m4"]),
         "--config.train.pipeline_schedule=zero_bubble", "--config.model.remat=full",
         "--config.train.pipeline_stash=1")
  run = load_run(str(tmp_path))
  assert run.config.model.remat == "full" and run.config.train.pipeline_stash == 1
  got = assert_trains_like(tmp_path, run, *reference, "zero_bubble with remat")
  assert_records_close(got, train_records(gpipe_dir), "zero_bubble with remat vs gpipe")


def _temp_bytes(loss, *args) -> int:
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_1f1b_holds_at_most_s_microbatches_where_lockstep_holds_2s_minus_1_and_gpipe_m():
  """Activation memory from the compiled step's memory_analysis, 4 stages of 2 wide layers
  at M = S, 2S, 4S: GPipe's grows by one microbatch's residuals per microbatch; 1F1B's
  ring is full at M = S (K = S = 4 slots) and stays flat; the lockstep schedule's grows to
  K = 2S - 1 = 7 slots, 3 microbatches' residuals above 1F1B's; zero bubble's is flat,
  above 1F1B's by its stash (train.pipeline_stash: S, or 1)."""
  D, H, S = 32, 256, 4
  mesh = make_mesh({"stage": S, "data": 8 // S})
  w = {"a": jnp.ones((8, D, H)) / 30, "b": jnp.ones((8, H, D)) / 30}
  v = jnp.ones((D, D))

  def layers(w, x, _):
    for i in range(w["a"].shape[0]):
      x = x + jnp.tanh(x @ w["a"][i]) @ w["b"][i]
    return x

  def tail(v, y, t):
    loss = jnp.sum((y @ v - t) ** 2)
    return loss, {"loss": loss}

  temp = {}
  for M in (S, 2 * S, 4 * S):
    x = jnp.ones((M, 16, 64, D))
    shift, target = jnp.zeros((M,)), jnp.ones_like(x)
    loss_1f1b = lambda schedule, stash=0: lambda w, v, x: one_f_one_b(
        lambda p, xb, s, k: (layers(p, xb, s), {}), tail, w, v, x, shift, target,
        schedule=schedule, stash=stash)[0]
    gpipe_loss = lambda w, v, x: jnp.sum(jax.vmap(lambda y, t: tail(v, y, t)[0])(
        pipeline.gpipe(lambda p, xb, s, k: (layers(p, xb, s), {}), w, x, shift)[0], target))
    with jax.set_mesh(mesh):
      temp[M] = [_temp_bytes(f, w, v, x) for f in (
          loss_1f1b("1f1b"), loss_1f1b("1f1b_lockstep"), gpipe_loss, loss_1f1b("zero_bubble"),
          loss_1f1b("zero_bubble", 1))]
  per_microbatch = (temp[16][2] - temp[8][2]) / 8  # GPipe: one microbatch's residuals.
  assert per_microbatch > 0
  assert (temp[8][2] - temp[4][2]) / 4 == pytest.approx(per_microbatch, rel=0.1)
  assert [ring_slots(S, M) for M in temp] == [4, 4, 4]
  assert [lockstep_slots(S, M) for M in temp] == [4, 7, 7]
  assert temp[16][0] - temp[4][0] < 0.5 * per_microbatch, temp  # Flat: 12 more in flight.
  assert temp[8][1] - temp[4][1] == pytest.approx(3 * per_microbatch, rel=0.25), temp
  assert temp[16][1] - temp[16][0] > 1.5 * per_microbatch, temp
  assert temp[16][0] < temp[16][2] / 3, temp
  # Zero bubble: flat in M too, above 1F1B by its stash (S slots: about 2.5 microbatches'
  # residuals here; a stash of 1: about one).
  assert temp[16][3] - temp[4][3] < 0.75 * per_microbatch, temp
  assert temp[16][4] < temp[16][3] - per_microbatch, temp
  assert temp[16][4] - temp[16][0] < 1.5 * per_microbatch, temp


def test_a_gpipe_checkpoint_resumes_with_1f1b(reference_1f1b, tmp_path):
  """The schedule is operational: the GPipe run's step-2 checkpoint resumed with 1F1B on
  the same mesh gives the uninterrupted run's steps 3 and 4."""
  import shutil

  from tests.cli import launch
  from tests.parallel.test_pipeline import flags, train_records
  from train import load_run
  _, gpipe_dir = reference_1f1b
  shutil.copytree(gpipe_dir, tmp_path, dirs_exist_ok=True)
  shutil.rmtree(tmp_path / "checkpoints" / "4")
  assert load_run(str(tmp_path)).step == 2
  launch("--workdir", str(tmp_path), *flags(*LAUNCHED["stage2_tensor4_m8"]),
         "--config.train.pipeline_schedule=1f1b")
  got, want = train_records(tmp_path), train_records(gpipe_dir)
  for key in ("loss", "grad_norm", "param_norm"):
    np.testing.assert_allclose([r[key] for r in got], [r[key] for r in want], rtol=1e-5,
                               atol=1e-6, err_msg=key)

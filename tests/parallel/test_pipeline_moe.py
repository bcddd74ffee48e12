"""MoE and MLA inside pipeline stages (mesh.stage): equal to the unpipelined step, through
launch.py on 8 devices, with the MoE's aux (loads, balance losses, the router-bias update)
carried out of the schedule.

Models (tiny.py:smoke, float32, constant learning rate, STEPS steps; tests/parallel/
test_pipeline.py's flags):
  mla_moe   DeepSeek-V3-shaped: MLA attention, 8 layers of which the first 4 dense and 4 MoE
            (4 experts, top-2), loss-free bias balancing, the sequence-wise and z aux losses
            on: both segments pipelined, on (stage=2, fsdp=4, M=2), (stage=4, data=2, M=4)
            and (stage=2, context=2, fsdp=2, M=2): MLA's ring attention inside the stages;
            and the circular schedule (stage=2, fsdp=4, M=2, R=2).
  mla_moe_one_segment  the same with 4 MoE layers and no dense ones (one segment): the
            1F1B schedule on (stage=2, data=2, tensor=2, M=4), the aux losses inside the
            schedule; 1F1B lockstep on (stage=2, expert=2, data=2, M=2): the experts
            split over mesh.expert inside the stages; all three 1F1B schedules on
            (stage=2, fsdp=2, tensor=2): the router's and MLA's D-split weights whole
            inside the per-stage switch.
  ep_switch GQA, 4 MoE layers, the Switch load-balancing loss (rebuilt from the summed loads
            and mean probabilities: not a mean over microbatches), the experts' weights
            split over mesh.expert inside the stages by GSPMD (moe_dispatch=
            'capacity_einsum'; stage=2, expert=2, data=2) and drops (capacity_factor 1).
The reference is the same config's pure train step on one device without a mesh.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import ModelConfig, Transformer
from model.moe import layer as moe
from model.transformer import layer_segments
from parallel import logical_rules, make_mesh, mesh_context, pipeline_circular
from tests.cli import launch
from tests.parallel.test_pipeline import (LOSS_TOL, STEPS, assert_records_close, flags,
                                          train_records)
from tests.parallel.test_train_equivalence import one_device_run
from train import load_run

MODELS = {
    "mla_moe": ("--config.model.attention_type=mla", "--config.model.q_lora_rank=16",
                "--config.model.kv_lora_rank=16", "--config.model.num_layers=8",
                "--config.model.first_k_dense=4", "--config.model.num_experts=4",
                "--config.model.load_balance=loss_free",
                "--config.model.bias_update_rate=0.01",
                "--config.model.seq_aux_loss_coef=0.01",
                "--config.model.router_z_loss_coef=0.001"),
    # One MoE segment (first_k_dense=0), which the 1F1B schedules (loss inside) run.
    "mla_moe_one_segment": ("--config.model.attention_type=mla", "--config.model.q_lora_rank=16",
                            "--config.model.kv_lora_rank=16", "--config.model.num_experts=4",
                            "--config.model.load_balance=loss_free",
                            "--config.model.bias_update_rate=0.01",
                            "--config.model.seq_aux_loss_coef=0.01",
                            "--config.model.router_z_loss_coef=0.001"),
    "ep_switch": ("--config.model.num_experts=4", "--config.model.load_balance=aux_loss",
                  "--config.model.aux_loss_coef=0.1", "--config.model.capacity_factor=1.0",
                  "--config.model.moe_dispatch=capacity_einsum"),
}
# name: (model, mesh sizes, pipeline microbatches, the schedule's flags).
RUNS = {
    "mla_moe_stage2_fsdp4": ("mla_moe", {"stage": 2, "fsdp": 4}, 2, ()),
    "mla_moe_stage4_data2": ("mla_moe", {"stage": 4, "data": 2}, 4, ()),
    "mla_moe_stage2_context2_fsdp2": ("mla_moe", {"stage": 2, "context": 2, "fsdp": 2}, 2, ()),
    "ep_switch_stage2_expert2": ("ep_switch", {"stage": 2, "expert": 2, "data": 2}, 2, ()),
    # The circular schedule: each segment's 4 layers are 2 stages x 2 repeats of 1 layer.
    "mla_moe_stage2_r2_fsdp4": ("mla_moe", {"stage": 2, "fsdp": 4}, 2,
                                ("--config.train.pipeline_repeats=2",)),
    # The 1F1B schedules: each stage's aux losses differentiated in its own backwards, the
    # loads carried out; M = 2S (the rings wrap) and M = S.
    "moe_stage2_data2_tensor2_1f1b": ("mla_moe_one_segment",
                                      {"stage": 2, "data": 2, "tensor": 2}, 4,
                                      ("--config.train.pipeline_schedule=1f1b",)),
    "moe_stage2_fsdp2_tensor2_1f1b_lockstep": (
        "mla_moe_one_segment", {"stage": 2, "fsdp": 2, "tensor": 2}, 2,
        ("--config.train.pipeline_schedule=1f1b_lockstep",)),
    "moe_stage2_expert2_data2_1f1b_lockstep": (
        "mla_moe_one_segment", {"stage": 2, "expert": 2, "data": 2}, 2,
        ("--config.train.pipeline_schedule=1f1b_lockstep",)),
    # fsdp x tensor: the router's gate and MLA's D-split down-projections used whole
    # inside the per-stage switch (model/layers.py Einsum `whole_in_stage`).
    "moe_stage2_fsdp2_tensor2_1f1b": ("mla_moe_one_segment",
                                      {"stage": 2, "fsdp": 2, "tensor": 2}, 4,
                                      ("--config.train.pipeline_schedule=1f1b",)),
    # The zero-bubble schedule: each stage's backward split into B and W (the router's and
    # experts' weight gradients in W), M = 2S.
    "moe_stage2_data2_tensor2_zero_bubble": (
        "mla_moe_one_segment", {"stage": 2, "data": 2, "tensor": 2}, 4,
        ("--config.train.pipeline_schedule=zero_bubble",)),
    "moe_stage2_fsdp2_tensor2_zero_bubble": (
        "mla_moe_one_segment", {"stage": 2, "fsdp": 2, "tensor": 2}, 2,
        ("--config.train.pipeline_schedule=zero_bubble",)),
}
# Every MoE figure the step logs per step (means over the MoE layers), beside the loss.
MOE_KEYS = ("moe_lb_loss", "moe_seq_loss", "moe_z_loss", "moe_aux_loss",
            "moe_router_entropy", "moe_dropped_frac", "moe_maxvio")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """run name -> workdir of its STEPS-step launch.py run, each at most once."""
  done = {}

  def get(name):
    if name not in done:
      model, mesh, microbatches, schedule = RUNS[name]
      workdir = tmp_path_factory.mktemp(name)
      launch("--workdir", str(workdir), *flags(mesh, microbatches), *MODELS[model],
             *(f"--config.mesh.{axis}={mesh.get(axis, 1)}" for axis in ("expert", "context")),
             *schedule)
      done[name] = workdir
    return done[name]

  return get


@pytest.fixture(scope="module")
def references(runs):
  """model -> one device's per-step metrics (no mesh, the run's config)."""
  done = {}

  def get(name):
    model = RUNS[name][0]
    if model not in done:
      done[model] = one_device_run(load_run(str(runs(name))).config, STEPS)[0]
    return done[model]

  return get


@pytest.mark.parametrize("name", list(RUNS))
def test_moe_and_mla_in_stages_train_like_one_device(name, runs, references):
  """Loss, gradient norm, parameter norm and every MoE metric per step, and the router
  biases loss-free balancing leaves after the steps, equal one device's. With the circular
  schedule the trainer holds the parameters in its pipeline order and the biases in layer
  order: a mix-up would move another layer's bias."""
  want = references(name)
  workdir = runs(name)
  train_cfg = load_run(str(workdir)).config.train
  for flag in RUNS[name][3]:  # The schedule ran: its flags are the run's config.
    key, value = flag.removeprefix("--config.train.").split("=")
    assert str(train_cfg[key]) == value, flag
  got = train_records(workdir)
  assert_records_close(got, want, name)
  for key in MOE_KEYS:
    np.testing.assert_allclose([r[key] for r in got], [float(w[key]) for w in want],
                               **LOSS_TOL, err_msg=f"{name}: {key} per step")
  assert got[0]["loss"] > got[-1]["loss"] + 1e-3  # It trains, so the check has teeth.
  if RUNS[name][0] == "ep_switch":
    assert max(r["moe_dropped_frac"] for r in got) > 0  # Capacity drops are carried too.
    return
  biases = load_run(str(workdir)).variables["moe_state"]
  got_YE = np.asarray(moe.router_biases(biases))
  first = 4 if RUNS[name][0] == "mla_moe" else 0
  want_YE = np.stack([np.asarray(want[-1][f"moe_bias/layer{i}"])
                      for i in range(first, first + 4)])
  assert np.abs(want_YE).max() > 0  # The biases moved.
  np.testing.assert_allclose(got_YE, want_YE, atol=1e-7, err_msg=f"{name}: router biases")


@pytest.mark.parametrize("dtype, tol, mesh_sizes, factor, repeats", [
    ("float32", 2e-6, {"stage": 2, "data": 2, "fsdp": 2}, 0.5, 1),
    ("bfloat16", 2e-2, {"stage": 2, "data": 2, "fsdp": 2}, 0.5, 1),
    ("float32", 2e-6, {"stage": 2, "context": 2, "data": 2}, 0.0, 1),
    ("float32", 2e-6, {"stage": 2, "data": 2, "fsdp": 2}, 0.5, 2),
    ("bfloat16", 2e-2, {"stage": 2, "data": 2, "fsdp": 2}, 0.5, 2)])
def test_moe_transformer_on_stages_equals_no_mesh(dtype, tol, mesh_sizes, factor, repeats):
  """Transformer with a dense and an MoE segment (loss-free biases set, the Switch loss,
  drops at capacity factor 0.5) on stages with data / fsdp, or context (GQA ring attention)
  inside, 4 microbatches, GPipe or the circular schedule (R = 2, the parameters in its
  pipeline order, the biases in layer order): hidden states, every aux entry (in layer
  order) and the gradients of a loss on both equal those without a mesh. With context no
  drops (factor 0): under a context axis the layers run in the zig-zag token order, which
  changes who is dropped (with or without stages; docs/scaling.md)."""
  n = 4 * repeats  # Two segments of 2 R layers: 2 stages x R repeats of one layer each.
  cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=n, num_heads=4, num_kv_heads=2,
                    mlp_dim=64, max_seq_len=16, pos_encoding="rope", dtype=dtype,
                    num_experts=4, experts_per_token=2, expert_mlp_dim=32, first_k_dense=n // 2,
                    load_balance="loss_free", seq_aux_loss_coef=0.1, router_z_loss_coef=0.01,
                    capacity_factor=factor)
  tokens_BL = jax.random.randint(jax.random.key(1), (16, 16), 0, 64)
  net = Transformer(cfg)
  variables = nn.unbox(net.init(jax.random.key(0), tokens_BL))
  bias = jax.random.normal(jax.random.key(2), (n // 2, 4)) * 0.05
  variables["moe_state"] = jax.tree.map(lambda _: bias, variables["moe_state"])
  segments = [name for name, *_ in layer_segments(cfg)]
  order = lambda f, p: {k: jax.tree.map(lambda x: f(x, 2, repeats), v) if k in segments else v
                        for k, v in p.items()}

  def loss(p, repeats):
    h, mutated = net.apply({**variables, "params": p}, tokens_BL, return_hidden=True,
                           pipeline_microbatches=4, pipeline_repeats=repeats, mutable=["aux"])
    lb = moe.moe_metrics(mutated)["moe_lb_loss"]  # Rebuilt under the pipeline.
    out = jnp.mean(jnp.sin(h.astype(jnp.float32) * 3)) + moe.total_aux_loss(mutated) + lb
    return out, (h, mutated["aux"])

  fn = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
  (_, (want_h, want_aux)), want_g = fn(variables["params"], 1)
  mesh = make_mesh(mesh_sizes)
  with mesh_context(mesh, logical_rules(mesh=mesh, num_kv_heads=2, num_heads=4)):
    params = order(pipeline_circular.to_pipeline_order, variables["params"])
    (_, (got_h, got_aux)), got_g = fn(params, repeats)
  got_g = order(pipeline_circular.to_layer_order, got_g)
  close = lambda g, w, **kw: np.testing.assert_allclose(
      np.asarray(g, np.float32), np.asarray(w, np.float32), **kw)
  close(got_h, want_h, atol=tol, rtol=tol)
  assert jax.tree.structure(got_aux) == jax.tree.structure(want_aux)
  assert (float(moe.moe_metrics({"aux": want_aux})["moe_dropped_frac"]) > 0) == (factor > 0)
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got_aux),
                          jax.tree.leaves(want_aux)):
    close(g, w, atol=tol, rtol=tol, err_msg=jax.tree_util.keystr(path))
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got_g), jax.tree.leaves(want_g)):
    close(g, w, atol=tol * 1e-1, rtol=tol * 10, err_msg=jax.tree_util.keystr(path))

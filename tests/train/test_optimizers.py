"""train.optimizer: each optimizer's first update against a numpy reference of its formula,
the default (adamw) bitwise what it was, Muon on fsdp/tensor-sharded stacked weights equal
to one device without gathering a whole weight, and each training through launch.py."""

import functools
import json
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util

from experiments.configs.base import train_defaults
from model import ModelConfig, Transformer
from parallel import make_mesh
from parallel.rules import logical_rules
from parallel.sharding import abstract_shardings, sharded_init
from tests.cli import launch
from train import checkpoint as ckpt
from train import load_run
from train.lifecycle import config_record, session
from train.optim import decay_mask, make_optimizer
from train.optimizers import matrix_dims, model_params, param_axes
from train.state import init_state

LR, WD, CLIP = 0.01, 0.1, 1.0
NS = (3.4445, -4.7750, 2.0315)  # optax.contrib.muon's (Jordan's) quintic coefficients.


def _cfg(**kw):
  return ModelConfig(vocab_size=64, d_model=kw.pop("d_model", 32), num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=8, mlp_dim=kw.pop("mlp_dim", 160),
                     max_seq_len=8, **kw)


def _setup(name, cfg=None):
  cfg = cfg or _cfg()
  t = train_defaults()
  t.update(optimizer=name, lr=LR, weight_decay=WD, grad_clip=CLIP, warmup_steps=0,
           schedule="constant")
  params = nn.unbox(Transformer(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
  params = params["params"]
  keys = iter(jax.random.split(jax.random.key(1), 100))
  grads = jax.tree.map(lambda p: jax.random.normal(next(keys), p.shape, p.dtype) * 0.05,
                       params)
  return cfg, t, params, grads


def _flat(tree):
  return {k: np.asarray(v, np.float64) for k, v in traverse_util.flatten_dict(tree).items()}


def _clipped(grads):
  g = _flat(grads)
  norm = np.sqrt(sum(np.sum(x * x) for x in g.values()))
  return {k: x * min(1.0, CLIP / norm) for k, x in g.items()}


def _adamw_direction(g, t):  # Step 1, bias-corrected: m = g, v = g².
  return g / (np.abs(g) + t.eps)


def _newton_schulz(x):
  """optax.contrib.muon's orthogonalisation of one matrix, in float64."""
  wide = x if x.shape[0] <= x.shape[1] else x.T
  wide = wide / (np.linalg.norm(wide) + 1e-8)
  for _ in range(5):
    a = wide @ wide.T
    wide = NS[0] * wide + (NS[1] * a + NS[2] * a @ a) @ wide
  return wide if x.shape[0] <= x.shape[1] else wide.T


def _muon_direction(k, g, names, t):
  dims = matrix_dims(k, names)
  if dims is None:
    return _adamw_direction(g, t)
  red, out = dims
  batch = [i for i in range(g.ndim) if i not in red + out]
  perm = batch + list(red) + list(out)
  x = np.transpose(g, perm)
  bshape, m, n = x.shape[:len(batch)], int(np.prod([g.shape[i] for i in red])), int(
      np.prod([g.shape[i] for i in out]))
  x = x.reshape(-1, m, n)
  beta = t.muon_momentum  # Nesterov at step 1: g * (1 + beta / (1 + beta)); scale-free.
  o = np.stack([_newton_schulz(s * (1 + beta / (1 + beta))) for s in x])
  o = o * 0.2 * np.sqrt(max(m, n))
  return np.transpose(o.reshape(*bshape, *[g.shape[i] for i in red + out]), np.argsort(perm))


def _adafactor_direction(g):
  g2 = g * g + 1e-30
  if g.ndim >= 2 and sorted(g.shape)[-2] >= 128:  # optax's factoring rule (dims >= 128).
    d1, d0 = np.argsort(g.shape)[-2:]
    row, col = g2.mean(axis=d0), g2.mean(axis=d1)
    row = row / row.mean(axis=d1 - (d1 > d0), keepdims=True)
    u = g * np.expand_dims(row, d0) ** -0.5 * np.expand_dims(col, d1) ** -0.5
  else:
    u = g / np.sqrt(g2)
  return u / max(1.0, np.sqrt(np.mean(u * u)))  # clip_by_block_rms(1).


def _reference(name, cfg, t, params, grads):
  """The first update, from the optimizer's formula."""
  g, p = _clipped(grads), _flat(params)
  decays = traverse_util.flatten_dict(decay_mask(params, t))
  axes = param_axes(cfg)
  out = {}
  for k in g:
    if name in ("adamw", "schedule_free_adamw"):  # Schedule-free's step 1: y1 = z1.
      d = _adamw_direction(g[k], t)
    elif name == "lion":
      d = np.sign(g[k])
    elif name == "adafactor":
      d = _adafactor_direction(g[k])
    else:
      d = _muon_direction(k, g[k], axes[k], t)
    out[k] = -LR * (d + WD * p[k] * decays[k])
  return out


CONFIGS = {"adafactor": {"d_model": 128},  # FFN matrices of 128 x 160: factored.
           "muon_moe": {"num_experts": 4, "experts_per_token": 2},  # Per expert.
           "muon_bf16": {"param_dtype": "bfloat16"}}  # Momentum and Newton-Schulz in bf16.


@pytest.mark.parametrize("case", ["adamw", "adafactor", "lion", "muon", "muon_moe",
                                  "muon_bf16", "schedule_free_adamw"])
def test_first_update_matches_the_formula(case):
  name = case.removesuffix("_moe").removesuffix("_bf16")
  cfg, t, params, grads = _setup(name, _cfg(**CONFIGS[case]) if case in CONFIGS else None)
  opt = make_optimizer(t, cfg)
  updates, _ = jax.jit(opt.update)(grads, opt.init(params), params)
  want = _reference(name, cfg, t, params, grads)
  got = _flat(updates)
  assert got.keys() == want.keys()
  for k in got:
    if case.endswith("bf16"):  # bfloat16 iterations (8-bit mantissa): close in norm.
      err = np.linalg.norm(got[k] - want[k]) / np.linalg.norm(want[k])
      assert err < 0.1, (k, err)
      continue
    # Muon: float32 Newton-Schulz against float64, to 1e-3 of the largest entry.
    atol = 1e-3 * np.abs(want[k]).max() if name == "muon" else 2e-7 * LR
    np.testing.assert_allclose(got[k], want[k], rtol=2e-4, atol=atol, err_msg=str(k))
  if case == "muon_moe":  # The expert weights took the Muon path, one matrix per expert.
    k = ("moe_layers", "ffn", "wi") if ("moe_layers", "ffn", "wi") in got else ("layers", "ffn", "wi")
    assert matrix_dims(k, param_axes(cfg)[k]) == ((2,), (3,))
  if name == "adafactor":  # ... and the FFN matrices were factored.
    assert sorted(params["layers"]["ffn"]["wi"]["w"].shape)[-2] >= 128


def test_schedule_free_evaluates_its_average():
  """Two steps by hand: z_t = z_{t-1} + AdamW-without-momentum step (at y), x the
  lr²-weighted average of z, y = b1 x + (1 - b1) z; model_params gives x."""
  cfg, t, params, grads = _setup("schedule_free_adamw")
  t.grad_clip = 0.0
  opt = make_optimizer(t, cfg)
  grads2 = jax.tree.map(lambda g: -0.5 * g + 0.01, grads)
  state = opt.init(params)
  u1, state = jax.jit(opt.update)(grads, state, params)
  y1 = optax.apply_updates(params, u1)
  u2, state = jax.jit(opt.update)(grads2, state, y1)
  y2 = optax.apply_updates(y1, u2)
  p, g1, g2 = _flat(params), _flat(grads), _flat(grads2)
  decays = traverse_util.flatten_dict(decay_mask(params, t))
  b1, b2 = t.b1, t.b2
  got_y, got_x = _flat(y2), _flat(model_params(_State(y2, state)))
  for k in p:
    z1 = p[k] - LR * (_adamw_direction(g1[k], t) + WD * p[k] * decays[k])
    nu = (b2 * (1 - b2) * g1[k] ** 2 + (1 - b2) * g2[k] ** 2) / (1 - b2 ** 2)
    y1k = z1  # Step 1: x1 = z1 (c = 1), so y1 = z1.
    z2 = z1 - LR * (g2[k] / (np.sqrt(nu) + t.eps) + WD * y1k * decays[k])
    x2 = 0.5 * z1 + 0.5 * z2  # c = lr² / (2 lr²) with a constant lr.
    np.testing.assert_allclose(got_y[k], b1 * x2 + (1 - b1) * z2, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(got_x[k], x2, rtol=1e-4, atol=1e-7)


class _State:
  def __init__(self, params, opt_state):
    self.params, self.opt_state = params, opt_state


@pytest.mark.parametrize("mup", [0, 16])
def test_default_adamw_is_bitwise_the_previous_optimizer(mup):
  from model import mup as mup_lib  # pylint: disable=g-import-not-at-top
  from train.optim import learning_rate_schedule, mup_labels  # pylint: disable=g-import-not-at-top
  cfg, t, params, grads = _setup("adamw", _cfg(mup_base_width=mup))
  t.update(schedule="cosine", warmup_steps=2, steps=10)
  parts = [optax.clip_by_global_norm(t.grad_clip),  # train/optim.py before the family.
           optax.adamw(learning_rate_schedule(t), b1=t.b1, b2=t.b2, eps=t.eps,
                       weight_decay=t.weight_decay, mask=lambda p: decay_mask(p, t))]
  if mup:
    parts.append(optax.multi_transform(
        {"hidden": optax.scale(1.0 / mup_lib.width_mult(cfg)), "vector": optax.identity()},
        mup_labels))
  old, new = optax.chain(*parts), make_optimizer(t, cfg)
  states = [old.init(params), new.init(params)]
  assert jax.tree.structure(states[0]) == jax.tree.structure(states[1])  # checkpoints load
  ps = [params, params]
  for i in range(3):
    g = jax.tree.map(lambda x: x * (i + 1), grads)
    for j, opt in enumerate((old, new)):
      u, states[j] = jax.jit(opt.update)(g, states[j], ps[j])
      ps[j] = optax.apply_updates(ps[j], u)
  for a, b in zip(jax.tree.leaves((ps[0], states[0])), jax.tree.leaves((ps[1], states[1]))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("name", ["muon", "schedule_free_adamw"])
def test_mup_scales_the_hidden_matrices_updates_by_one_over_m(name):
  """µP at width multiplier 2: the hidden matrices' first update (Muon's orthogonalised
  one; schedule-free's z step, which y takes at step 1) is half the SP one, the rest equal."""
  from train.optim import mup_labels  # pylint: disable=g-import-not-at-top
  cfg, t, params, grads = _setup(name)
  got = {}
  for base in (0, 16):  # d_model 32: m = 2.
    opt = make_optimizer(t, cfg.replace(mup_base_width=base))
    got[base] = _flat(jax.jit(opt.update)(grads, opt.init(params), params)[0])
  labels = traverse_util.flatten_dict(mup_labels(params))
  assert "hidden" in labels.values()
  for k, sp in got[0].items():
    want = sp / 2 if labels[k] == "hidden" else sp
    np.testing.assert_allclose(got[16][k], want, rtol=1e-5, atol=1e-12, err_msg=str(k))


def _gathered_shapes(compiled_text: str) -> set[tuple[int, ...]]:
  """The shapes all-gathers produce (each operand's, where XLA combined several)."""
  outs = re.findall(r"= (.*?) all-gather(?:-start)?\(", compiled_text)
  return {tuple(int(d) for d in dims.split(",") if d)
          for out in outs for dims in re.findall(r"\w+\[([\d,]*)\]", out)}


MESHES = {"fsdp_tensor": ({"data": 2, "fsdp": 2, "tensor": 2}, {},
                          ("layers", "ffn", "wi", "w"), jax.P(None, "fsdp", "tensor")),
          "expert_tensor": ({"data": 2, "expert": 2, "tensor": 2},
                            {"num_experts": 4, "experts_per_token": 2},
                            ("layers", "ffn", "wi"), jax.P(None, "expert", None, "tensor"))}


@pytest.mark.parametrize("layout", list(MESHES))
def test_muon_sharded_equals_one_device_without_gathering_a_weight(layout):
  """fsdp x tensor (dense) and expert x tensor (MoE) on 8 CPU devices: the update equals
  the single-device one, and no all-gather in the compiled update yields a whole Muon
  matrix (stacked, one layer or expert, or a [..., fan_in, fan_out] view) on a device."""
  axes, model, wi, wi_spec = MESHES[layout]
  cfg = _cfg(d_model=96, mlp_dim=256, **model)
  _, t, _, _ = _setup("muon", cfg)
  opt = make_optimizer(t, cfg)
  mesh = make_mesh(axes)
  rules = logical_rules(mesh=mesh, num_kv_heads=2, num_heads=4)
  init_fn = functools.partial(init_state, cfg, opt, 0, 8)
  _, sh = abstract_shardings(init_fn, mesh=mesh, rules=rules)
  state, _ = sharded_init(init_fn, mesh=mesh, rules=rules, shardings=sh)
  assert traverse_util.flatten_dict(sh.params)[wi].spec == wi_spec
  grads = jax.tree.map(lambda p: p * 3.0 + 0.01, state.params)
  update = jax.jit(opt.update, in_shardings=(sh.params, sh.opt_state, sh.params),
                   out_shardings=(sh.params, sh.opt_state))
  got, _ = update(grads, state.opt_state, state.params)
  host = jax.tree.map(np.asarray, (grads, state.opt_state, state.params))
  want, _ = jax.jit(opt.update)(*host)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-8)
  whole = set()
  for k, names in param_axes(cfg).items():
    dims = matrix_dims(k, names)
    # The expert layout checks the expert weights: its attention k / v (96 x 16, split
    # only 2-way over tensor) GSPMD does gather whole, the cheaper plan at that size.
    if dims is None or (layout == "expert_tensor" and "expert" not in names):
      continue
    shape = traverse_util.flatten_dict(host[2])[k].shape
    m, n = (int(np.prod([shape[i] for i in d])) for d in dims)
    lead = shape[:len(shape) - len(dims[0]) - len(dims[1])]  # the stacking axes
    whole |= {shape, shape[1:], lead + (m, n), lead + (n, m), (m, n), (n, m)}
  text = update.lower(grads, state.opt_state, state.params).compile().as_text()
  gathered = _gathered_shapes(text)
  assert gathered and not gathered & whole, sorted(gathered & whole)
  if layout == "expert_tensor":  # Nor all 4 experts of a stacked [2, 4, ...] weight.
    assert not [g for g in gathered if g[:2] == (2, 4)], sorted(gathered)
  # The check sees a whole-weight gather where there is one.
  w = traverse_util.flatten_dict(state.params)[wi]
  replicate = jax.jit(lambda x: x * 2, out_shardings=jax.NamedSharding(mesh, jax.P()))
  assert w.shape in _gathered_shapes(replicate.lower(w).compile().as_text())


def test_adafactor_state_is_sharded_like_its_parameter():
  """Factored statistics keep the names of the axes they keep; unfactored second moments
  take the parameter's spec; placeholders and counters are replicated."""
  cfg = _cfg(d_model=128, mlp_dim=256)
  _, t, _, _ = _setup("adafactor", cfg)
  mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  rules = logical_rules(mesh=mesh, num_kv_heads=2, num_heads=4)
  init_fn = functools.partial(init_state, cfg, make_optimizer(t, cfg), 0, 8)
  template, sh = abstract_shardings(init_fn, mesh=mesh, rules=rules)
  factored = sh.opt_state[1][0]  # (clip, (scale_by_factored_rms, ...)).
  wi, wo = ("layers", "ffn", "wi", "w"), ("layers", "ffn", "wo", "w")
  spec = lambda tree, k: traverse_util.flatten_dict(tree)[k].spec
  assert spec(sh.params, wi) == jax.P(None, "fsdp", "tensor")  # [layers, 128, 256]
  assert spec(factored.v_row, wi) == jax.P(None, "fsdp")  # the 256 (mlp) axis averaged
  assert spec(factored.v_col, wi) == jax.P(None, "tensor")  # the 128 (embed) axis averaged
  assert spec(factored.v_row, wo) == jax.P(None, "fsdp")  # wo [layers, 256, 128]: mlp out
  assert spec(factored.v_col, wo) == jax.P(None, "tensor")
  q = ("layers", "attn", "q", "w")  # [layers, 128, 4, 8]: not factored (one dim >= 128).
  assert spec(factored.v, q) == spec(sh.params, q) == jax.P(None, "fsdp", "tensor", None)
  assert spec(factored.v, wi) == jax.P()  # its (1,) placeholder
  assert traverse_util.flatten_dict(template.opt_state[1][0].v)[wi].shape == (1,)


def test_unknown_optimizer_is_refused_with_the_valid_names(tmp_path):
  with pytest.raises(ValueError, match=r"config.train.optimizer='sgd'.*'adamw', 'adafactor', "
                                       r"'lion', 'muon', 'schedule_free_adamw'"):
    launch("--workdir", str(tmp_path), "--config.train.optimizer=sgd")
  with pytest.raises(ValueError, match="train.schedule.*schedule_free_adamw.*'constant'"):
    launch("--workdir", str(tmp_path), "--config.train.optimizer=schedule_free_adamw")


RUN = ("--config.train.async_checkpoint=False", "--config.train.tensorboard=False",
       "--config.train.log_every=1", "--config.train.checkpoint_every=2",
       "--config.train.schedule=constant", "--config.train.warmup_steps=0",
       "--config.train.lr=3e-3", "--config.train.eval_every=100",
       # With the z-loss and a spike guard that drops updates: both see any optimizer state.
       "--config.train.z_loss=1e-4", "--config.train.on_spike=skip_batch")


def _train_losses(workdir):
  with open(workdir / "metrics.jsonl") as f:
    return [r["loss"] for r in map(json.loads, f) if r["split"] == "train"]


def _raw_state(workdir):
  """The checkpoint's TrainState as it was saved (load_run gives model_params of it)."""
  spec = config_record.read_spec(str(workdir))
  s = session.open_run(spec, str(workdir), "read", devices=jax.local_devices()[:1])
  manager = ckpt.make_manager(str(workdir), read_only=True)
  try:
    return ckpt.restore_latest(manager, str(workdir), s.template, s.shardings)[0]
  finally:
    manager.close()


@pytest.mark.parametrize("name", ["adafactor", "lion", "muon", "schedule_free_adamw"])
def test_trains_through_launch_and_resumes_bitwise(tmp_path, name):
  """4 steps straight, and 2 steps then a resume to 4: the same losses and the same final
  parameters bit for bit (the optimizer state came back whole)."""
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  launch("--workdir", str(straight), *RUN, f"--config.train.optimizer={name}",
         "--config.train.steps=4")
  run = load_run(str(straight))
  assert run.config.train.optimizer == name
  losses = _train_losses(straight)
  assert len(losses) == 4 and all(np.isfinite(losses)) and losses[-1] < losses[0]
  if name == "schedule_free_adamw":  # Evaluated (and loaded) at x, not at the y it trains.
    state = _raw_state(straight)
    x = model_params(state)
    for a, b in zip(jax.tree.leaves(run.variables["params"]), jax.tree.leaves(x)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(x),
                                                        jax.tree.leaves(state.params)))
  if name not in ("muon", "adafactor"):
    return
  launch("--workdir", str(resumed), *RUN, f"--config.train.optimizer={name}",
         "--config.train.steps=2")
  launch("--workdir", str(resumed), *RUN, f"--config.train.optimizer={name}",
         "--config.train.steps=4")
  assert _train_losses(resumed) == losses
  for a, b in zip(jax.tree.leaves(load_run(str(resumed)).variables),
                  jax.tree.leaves(run.variables)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

"""model.quantization: Qwix's quantized dots against a direct reference, and what they
touch in a Transformer (projections and experts; never the router, scores or, unless
asked, the head), composed with scan, remat and bfloat16."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import qwix

from model import ModelConfig, Transformer
from model import quantization as q
from model.layers import Einsum
from model.backend import target_backend
from model.transformer import unstack_layers
from parallel import logical_rules, make_mesh, mesh_context

BASE = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
            mlp_dim=64, max_seq_len=16)


class Proj(nn.Module):
  """One projection named as a real one ("wi"), so the projection rule matches it."""
  dtype: str = "float32"

  @nn.compact
  def __call__(self, x_MD):
    return Einsum((x_MD.shape[-1], 6), ("embed", "mlp"), dtype=self.dtype, name="wi")(
        "MD,DF->MF", x_MD)


def _proj(quantization: str, x_MD, w_DF, dtype="float32"):
  cfg = ModelConfig(**BASE, quantization=quantization)
  variables = {"params": {"wi": {"w": jnp.asarray(w_DF)}}}
  return np.asarray(q.quantized(Proj(dtype), cfg).apply(variables, jnp.asarray(x_MD)),
                    np.float32)


def _operands(seed: int, bound: float, M=5, D=8, F=6):
  """x [M, D] and w [D, F] whose per-channel absmax (rows of x, columns of w) is `bound`
  times a power of two: every scale absmax / bound is exact, so is every x / scale, and
  the reference below is exact arithmetic, ties included. Signs alternate by channel."""
  kx, kw = jax.random.split(jax.random.key(seed))
  def fit(a, axis, peak):
    a = np.array(a, np.float32)
    at = np.expand_dims(np.argmax(np.abs(a), axis=axis), axis)
    sign = np.sign(np.take_along_axis(a, at, axis))
    flip = np.where(np.arange(a.shape[1 - axis]) % 2, -1.0, 1.0).reshape(sign.shape)
    return (a / np.take_along_axis(a, at, axis) * flip * peak).astype(np.float32)
  x = fit(jax.random.normal(kx, (M, D)), 1, bound * 2.0 ** -4)
  w = fit(jax.random.normal(kw, (D, F)), 0, bound * 2.0 ** -9)
  return x, w


def _int8(a, axis):
  """Per-channel symmetric int8 as Qwix defines it: scale absmax / 127.5 (the 127 bucket
  covers [126.5, 127.5)), round half to even, saturate to [-128, 127]."""
  scale = (np.abs(a).max(axis=axis, keepdims=True) / np.float32(127.5)).astype(np.float32)
  return np.clip(np.round(a / scale), -128, 127), scale


def test_int8_projection_is_the_integer_dot_of_per_channel_rounded_operands():
  x_MD, w_DF = _operands(0, 127.5)
  y = _proj("int8", x_MD, w_DF)
  qx, sx = _int8(x_MD, axis=1)  # One scale per row (token) of the activation...
  qw, sw = _int8(w_DF, axis=0)  # ...and per output column of the weight.
  # Each channel's absmax entry is +-127.5 scales: the tie rounds to +-128, and +128 must
  # saturate to 127 (an int8 wrap-around would give -128).
  assert (qx == 127).any() and (qx == -128).any() and (qw == 127).any() and (qw == -128).any()
  want = (qx @ qw).astype(np.float32) * sx * sw
  np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-7)
  exact = x_MD @ w_DF
  assert 0 < np.abs(y - exact).max() < 0.02 * np.abs(exact).max()  # Quantized, not broken.


def test_fp8_projection_is_the_float_dot_of_e4m3_scaled_operands():
  e4m3 = ml_dtypes.float8_e4m3fn
  fmax = np.float32(ml_dtypes.finfo(e4m3).max)  # 448: absmax maps onto it, nothing clips.
  x_MD, w_DF = _operands(2, float(fmax))
  y = _proj("fp8", x_MD, w_DF)

  def fp8(a, axis):
    scale = (np.abs(a).max(axis=axis, keepdims=True) / fmax).astype(np.float32)
    return (a / scale).astype(e4m3).astype(np.float32), scale
  (qx, sx), (qw, sw) = fp8(x_MD, 1), fp8(w_DF, 0)
  assert np.abs(qx).max() == fmax
  np.testing.assert_allclose(y, (qx @ qw) * sx * sw, rtol=1e-6, atol=1e-7)


def test_int8_weight_only_rounds_the_weight_and_keeps_the_activation():
  x_MD, w_DF = _operands(3, 127.5)
  qw, sw = _int8(w_DF, axis=0)
  np.testing.assert_allclose(_proj("int8_weight", x_MD, w_DF), x_MD @ (qw * sw),
                             rtol=1e-6, atol=1e-7)


def _einsum_paths(cfg):
  """Module path of every Einsum module a forward pass calls."""
  paths = set()

  def spy(next_fun, args, kwargs, context):
    if isinstance(context.module, Einsum) and context.method_name == "__call__":
      paths.add("/".join(context.module.path))
    return next_fun(*args, **kwargs)
  tokens = jnp.ones((1, 4), jnp.int32)
  with nn.intercept_methods(spy):
    Transformer(cfg).init(jax.random.key(0), tokens)
  return paths


@pytest.mark.parametrize("extra", [
    dict(), dict(attention_type="mla", num_kv_heads=4, q_lora_rank=8),
    dict(num_experts=4, num_shared_experts=1, moe_dispatch="capacity_einsum")],
    ids=["gqa", "mla", "moe"])
def test_every_einsum_is_a_known_projection_the_router_or_the_head(extra):
  """A new Einsum name would silently stay unquantized: PROJECTIONS must list it."""
  for path in _einsum_paths(ModelConfig(**{**BASE, **extra})):
    name = path.split("/")[-1]
    assert name in q.PROJECTIONS or path.endswith("router/gate") or name == "unembed", path


def _loss(cfg, variables, tokens):
  def f(params):
    logits, _ = q.quantized(Transformer(cfg), cfg).apply(
        {**variables, "params": params}, tokens, mutable=["aux"])
    return jnp.mean(jax.nn.logsumexp(logits.astype(jnp.float32), -1) - logits[..., 0])
  return jax.jit(jax.value_and_grad(f))(variables["params"])


def _setup(**kw):
  cfg = ModelConfig(**{**BASE, **kw})
  tokens = jax.random.randint(jax.random.key(5), (2, 8), 0, BASE["vocab_size"])
  return cfg, Transformer(cfg.replace(quantization="none")).init(jax.random.key(0), tokens), tokens


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_model_tracks_the_unquantized_one_and_adds_no_variables(dtype):
  cfg, variables, tokens = _setup(dtype=dtype, quantization="int8")
  # Same variables with and without quantization: checkpoints keep master weights.
  assert jax.tree.structure(Transformer(cfg).init(jax.random.key(0), tokens)) == \
      jax.tree.structure(variables)
  (l8, g8), (l0, g0) = _loss(cfg, variables, tokens), _loss(cfg.replace(quantization="none"),
                                                          variables, tokens)
  assert l8 != l0 and abs(float(l8) - float(l0)) < 0.01 * abs(float(l0)), (l8, l0)
  cos = [float(jnp.vdot(a, b) / (jnp.linalg.norm(a) * jnp.linalg.norm(b)))
         for a, b in zip(jax.tree.leaves(g8), jax.tree.leaves(g0)) if a.ndim > 1]
  assert min(cos) > 0.95, cos  # int8 gradients point where the float ones do.
  assert jax.tree.structure(g8) == jax.tree.structure(g0)


def test_quantize_head_is_what_changes_the_head():
  cfg, variables, tokens = _setup(quantization="int8")
  with_head = _loss(cfg.replace(quantize_head=True), variables, tokens)[0]
  assert float(with_head) != float(_loss(cfg, variables, tokens)[0])


@pytest.mark.parametrize("kw", [dict(scan_layers=False), dict(remat="full"),
                                dict(remat="save_dots")], ids=["unscanned", "remat", "save_dots"])
def test_int8_is_the_same_function_scanned_unrolled_and_rematerialised(kw):
  cfg, variables, tokens = _setup(quantization="int8")
  loss, grads = _loss(cfg, variables, tokens)
  cfg2 = cfg.replace(**kw)
  # Same weights, in the unscanned layout (`layer_{i}`) where the stack is unrolled.
  v2 = variables if cfg2.scan_layers else {"params": unstack_layers(cfg, variables["params"])}
  loss2, _ = _loss(cfg2, v2, tokens)
  np.testing.assert_allclose(float(loss2), float(loss), rtol=1e-5)


@pytest.mark.parametrize("fields, match", [
    (dict(quantization="int4"), "quantization"),
    (dict(quantize_head=True), "quantize_head"),
    (dict(quantization="int8_weight", num_experts=4, moe_dispatch="dropless"), "shard_map"),
])
def test_refused_configs_name_the_field(fields, match):
  with pytest.raises(ValueError, match=match):
    ModelConfig(**BASE, **fields)


@pytest.mark.parametrize("dispatch", ["capacity_einsum", "capacity_gather", "dropless"])
def test_moe_expert_matmuls_are_quantized_under_each_local_dispatch(dispatch):
  """Every rule matches something: the projections, and the experts' dot_generals (the
  blocked grouped matmul of "dropless" on CPU included)."""
  cfg, variables, tokens = _setup(quantization="int8", num_experts=4, moe_dispatch=dispatch)
  provider = qwix.QtProvider(q.rules(cfg))
  qwix.quantize_model(Transformer(cfg), provider).apply(variables, tokens, mutable=["aux"])
  assert not provider.get_unused_rules(), provider.get_unused_rules()


@pytest.mark.parametrize("axes", [{"data": 2, "fsdp": 2, "tensor": 2},
                                  {"stage": 2, "data": 2, "tensor": 2}],
                         ids=["data-fsdp-tensor", "pipeline"])
def test_int8_on_a_mesh_equals_no_mesh(axes):
  """Quantization under GSPMD sharding and inside pipeline stages (each stage's layers are
  a nested apply): the same quantized function as on one device, up to the float sums'
  order (which can move an entry across a rounding boundary: a loose tolerance)."""
  cfg = ModelConfig(**{**BASE, "num_layers": 4}, quantization="int8")
  tokens = jax.random.randint(jax.random.key(1), (16, 16), 0, BASE["vocab_size"])
  params = nn.unbox(Transformer(cfg).init(jax.random.key(0), tokens))["params"]
  net = q.quantized(Transformer(cfg), cfg)

  def loss(p):
    h = net.apply({"params": p}, tokens, return_hidden=True, pipeline_microbatches=4)
    return jnp.mean(jnp.sin(h * 3))
  fn = jax.jit(jax.value_and_grad(loss))
  want, want_g = fn(params)
  mesh = make_mesh(axes)
  with mesh_context(mesh, logical_rules(mesh=mesh, num_kv_heads=2, num_heads=4)):
    assert "xi8>" in fn.lower(params).as_text()
    got, got_g = fn(params)
  np.testing.assert_allclose(float(got), float(want), rtol=1e-4)
  for g, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-4, rtol=0.05)


def test_on_tpu_quantized_dropless_experts_take_ragged_dot_not_megablox():
  """Megablox (a Pallas kernel) is what "dropless" runs on TPU at lane-sized widths; Qwix
  cannot quantize inside it, so a quantized trace takes lax.ragged_dot, which it does.
  Traced here for TPU (model.backend), lowered for this CPU: Megablox could not be."""
  cfg, variables, tokens = _setup(quantization="int8", num_experts=4, moe_dispatch="dropless",
                                  d_model=128, expert_mlp_dim=128, num_heads=2,
                                  num_kv_heads=2, attention_impl="xla")  # Not Splash.
  provider = qwix.QtProvider(q.rules(cfg))
  net = qwix.quantize_model(Transformer(cfg), provider)
  with target_backend("tpu"):
    text = jax.jit(lambda v: net.apply(v, tokens, mutable=["aux"])[0]).lower(variables).as_text()
  i = text.find("tpu_custom_call")
  assert i < 0, text[max(0, i - 600):i + 100]
  assert not provider.get_unused_rules()

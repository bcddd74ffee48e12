"""Per-layer patterns (attention_pattern, rope_pattern): equal to the pattern-free model
where they say nothing, local layers see only their window, NoPE layers see no order,
scan == no scan, decoding (ring-buffer caches) == the full forward, validation, configs."""

import functools
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import ModelConfig, Transformer
from model import decode as dec
from model.decode.cache import cache_bytes, init_cache
from model.decode.sampling import Sampling
from model.transformer import stack_layers, unstack_layers
from train.generate import pad_prompts

BASE = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=64,
            max_seq_len=32)
W = 3  # The local layers' window.


def make(**kw):
  return ModelConfig(**{**BASE, **kw})


@functools.cache
def init(cfg):
  return nn.unbox(jax.jit(Transformer(cfg).init)(jax.random.key(0), jnp.zeros((1, 4), int)))


@functools.cache
def forward(cfg):
  return jax.jit(Transformer(cfg).apply)


def tokens(shape=(2, 12), seed=0):
  return jax.random.randint(jax.random.key(seed), shape, 0, BASE["vocab_size"])


@pytest.mark.parametrize("patterns", [
    dict(attention_pattern=("global", "global"), sliding_window=W),  # The window is unused.
    dict(rope_pattern=("rope",)),
])
def test_patterns_of_one_kind_are_the_pattern_free_model(patterns):
  plain, patterned = make(), make(**patterns)
  assert patterned.layer_period == 1
  v_plain, v_pat = init(plain), init(patterned)
  # Same tree (checkpoints and HF interop read it), same initial values, same numbers.
  assert jax.tree.structure(v_plain) == jax.tree.structure(v_pat)
  jax.tree.map(np.testing.assert_array_equal, v_plain, v_pat)
  t = tokens()
  np.testing.assert_array_equal(forward(plain)(v_plain, t), forward(patterned)(v_plain, t))


def _changed_positions(cfg, t_L, perturb_at):
  """Positions whose logits change when token `perturb_at` changes (one call, B = 2)."""
  t2 = t_L.at[perturb_at].set((t_L[perturb_at] + 1) % BASE["vocab_size"])
  logits = np.asarray(forward(cfg)(init(cfg), jnp.stack([t_L, t2])))
  return set(np.nonzero(np.abs(logits[0] - logits[1]).max(-1) > 1e-6)[0].tolist())


@pytest.mark.parametrize("impl", ["xla", "blockwise"])
def test_local_layers_see_only_their_window(impl):
  t_L = tokens((12,))
  kw = dict(sliding_window=W, attention_impl=impl, attention_block_q=4, attention_block_kv=4)
  one = dict(num_layers=1, **kw)
  # A local layer: token 2 reaches slots 2..2+W-1 only.
  assert _changed_positions(make(attention_pattern=("local",), **one), t_L, 2) == {2, 3, 4}
  # A global layer (the window is the local layers'): every later slot.
  assert _changed_positions(make(attention_pattern=("global",), **one), t_L, 2) == set(
      range(2, 12))
  # Two local layers reach 2 (W - 1) back; local then global reaches everything.
  two = dict(num_layers=2, **kw)
  assert _changed_positions(make(attention_pattern=("local",), **two), t_L, 2) == set(
      range(2, 2 + 2 * (W - 1) + 1))
  assert _changed_positions(make(attention_pattern=("local", "global"), **two), t_L,
                            2) == set(range(2, 12))


def test_every_implementation_gets_each_layers_window(monkeypatch):
  """cuDNN and Splash (through their CPU-runnable forms: jax.nn.dot_product_attention's XLA
  implementation, the Pallas interpreter) receive each layer's window and give the
  reference's logits."""
  from model.attention import gqa as attention, kernels as attention_kernels  # pylint: disable=g-import-not-at-top
  seen = []

  def recording(fn, **kw):
    def attend(q, k, v, data, spec):
      seen.append(spec.sliding_window)
      return fn(q, k, v, data, spec, **kw)
    return attend

  monkeypatch.setitem(attention.IMPLS, "cudnn",
                      recording(attention_kernels.cudnn_attention, implementation="xla"))
  monkeypatch.setitem(attention.IMPLS, "splash",
                      recording(attention_kernels.splash_attention, interpret=True))
  t = tokens()
  for impl, dtype, atol in [("cudnn", "bfloat16", 2e-2), ("splash", "float32", 1e-5)]:
    ref = make(attention_pattern=("local", "global"), sliding_window=W, dtype=dtype,
               scan_layers=False)
    cfg = ref.replace(attention_impl=impl)
    seen.clear()
    got = jax.jit(Transformer(cfg).apply)(init(ref), t)
    assert seen == [W, 0], impl
    np.testing.assert_allclose(got, forward(ref)(init(ref), t), atol=atol, err_msg=impl)


def test_nope_layers_see_no_order():
  # With no positional encoding, the last query's attention is a function of the set of
  # earlier tokens: reversing them leaves its logits unchanged; a RoPE layer sees order.
  t_L = tokens((8,))
  shuffled_L = jnp.concatenate([t_L[:-1][::-1], t_L[-1:]])
  for pattern, invariant in [(("nope",), True), (("rope",), False), (("rope", "nope"), False)]:
    cfg = make(num_layers=len(pattern), rope_pattern=pattern)
    last = np.asarray(forward(cfg)(init(cfg), jnp.stack([t_L, shuffled_L])))[:, -1]
    assert np.allclose(last[0], last[1], atol=1e-5) == invariant, pattern


@pytest.mark.parametrize("kw", [
    # Period lcm(2, 4) = 4 over 8 layers: a scanned body of 4 blocks, 2 repeats; remat.
    dict(num_layers=8, attention_pattern=("local", "global"),
         rope_pattern=("rope", "rope", "rope", "nope"), remat="full"),
    # MoE: a dense segment (one period) and an MoE segment (two repeats of local, global).
    dict(num_layers=6, attention_pattern=("local", "global"), num_experts=4, first_k_dense=2,
         capacity_factor=0.0),
], ids=["dense-period4", "moe-two-segments"])
def test_scan_equals_no_scan(kw):
  scanned = make(sliding_window=W, scan_layers=True, **kw)
  plain = scanned.replace(scan_layers=False, remat="none")
  v = init(scanned)
  P = scanned.layer_period
  params = v["params"]
  name = "layers" if not scanned.num_experts else "moe_layers"
  assert sorted(params[name]) == [f"block_{j}" for j in range(P)]
  leading = {x.shape[0] for x in jax.tree.leaves(params[name])}
  assert leading == {(scanned.num_layers - scanned.first_k_dense) // P}
  v_plain = {c: unstack_layers(scanned, tree) for c, tree in v.items()}
  assert jax.tree.structure(v_plain) == jax.tree.structure(init(plain))
  jax.tree.map(np.testing.assert_array_equal, {c: stack_layers(scanned, tree)
                                               for c, tree in v_plain.items()}, v)
  t = tokens()
  run = lambda cfg, v: jax.jit(functools.partial(Transformer(cfg).apply, mutable=["aux"]))(v, t)
  (y1, aux1), (y2, aux2) = run(scanned, v), run(plain, v_plain)
  np.testing.assert_allclose(y1, y2, rtol=1e-5, atol=1e-5)
  if scanned.num_experts:  # Per-layer MoE metrics name the same layers (interleaved blocks).
    from model.moe import layer as moe  # pylint: disable=g-import-not-at-top
    m1, m2 = moe.moe_metrics(aux1, scanned.first_k_dense), moe.moe_metrics(aux2, 2)
    assert set(m1) == set(m2) and "moe_load/layer5" in m1
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), m1, m2)


def test_decode_with_ring_caches_equals_full_forward():
  cfg = make(num_layers=4, attention_pattern=("local", "global"), sliding_window=W,
             rope_pattern=("rope", "rope", "rope", "nope"))
  v = init(cfg)
  # Lengths 5 and 2: left padding; 7 prompt slots + 6 new tokens outgrow the 3-slot rings
  # both in prefill (a chunk longer than the ring) and step by step.
  prompts, T = [[5, 9, 2, 7, 1, 8, 3], [3, 8]], 6
  tokens_BP, valid_BP = pad_prompts(prompts, cfg.vocab_size)
  P = tokens_BP.shape[1]
  cache = init_cache(cfg, 2, P + T - 1)
  sizes = {name: layer["attn"]["cached_key"].shape[1] for name, layer in cache.items()}
  assert sizes == {"layer_0": W, "layer_1": P + T - 1, "layer_2": W, "layer_3": P + T - 1}
  cache, logits_BV, pos_B = dec.prefill(cfg, v, tokens_BP, valid_BP, P + T - 1)
  out = dec.decode(cfg, v, cache, logits_BV, pos_B, jax.random.key(0), Sampling.make(),
                   jnp.int32(-1), max_new_tokens=T, return_logits=True)
  gen_BT, logits_BTV = np.asarray(out["tokens_BT"]), np.asarray(out["logits_BTV"])
  rows = [p + list(g) for p, g in zip(prompts, gen_BT)]
  right_BL = np.zeros((2, P + T), np.int32)
  for b, r in enumerate(rows):
    right_BL[b, :len(r)] = r
  full_BLV = np.asarray(forward(cfg)(v, right_BL))
  for b, p in enumerate(prompts):
    want_TV = full_BLV[b, len(p) - 1:len(p) - 1 + T]
    np.testing.assert_array_equal(gen_BT[b], want_TV.argmax(-1))
    np.testing.assert_allclose(logits_BTV[b], want_TV, atol=1e-5, rtol=0)


def test_ring_caches_stop_growing_at_the_window():
  cfg = make(num_layers=4, attention_pattern=("local", "global"), sliding_window=4)
  glob = cfg.replace(attention_pattern=(), sliding_window=0)
  for n in (4, 9, 30):  # Past the window only the global layers grow: half the cache.
    assert cache_bytes(cfg, 2, n + 1) - cache_bytes(cfg, 2, n) == (
        cache_bytes(glob, 2, n + 1) - cache_bytes(glob, 2, n)) // 2


@pytest.mark.parametrize("kw,match", [
    (dict(attention_pattern=("local", "global")), r"attention_pattern.*sliding_window > 0"),
    (dict(attention_pattern=("local", "global", "global"), sliding_window=2),
     r"attention_pattern.*must divide num_layers=2"),
    (dict(attention_pattern=("sliding",), sliding_window=2), r"attention_pattern.*entries"),
    (dict(attention_pattern="local", sliding_window=2), r"attention_pattern.*tuple"),
    (dict(rope_pattern=(True, False)), r"rope_pattern.*tuple"),
    (dict(rope_pattern=("rope", "nope"), pos_encoding="alibi"),
     r"rope_pattern.*pos_encoding='rope'"),
    (dict(num_layers=4, rope_pattern=("rope", "nope"), num_experts=4, first_k_dense=1),
     r"first_k_dense.*period 2"),
])
def test_invalid_patterns_name_the_field(kw, match):
  with pytest.raises(ValueError, match=match):
    make(**kw)


def test_patterns_round_trip_through_json_and_the_command_line():
  from experiments import sweep  # pylint: disable=g-import-not-at-top
  from experiments.configs import base  # pylint: disable=g-import-not-at-top
  from train.spec import model_config  # pylint: disable=g-import-not-at-top
  cfg = make(attention_pattern=("local", "global"), sliding_window=W, rope_pattern=("nope",))
  back = ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))  # config.json: lists.
  assert back == cfg and hash(back) == hash(cfg) and back.attention_pattern == ("local", "global")
  c = base.get_config("smoke")
  assert (c.model.attention_pattern, c.model.rope_pattern) == ((), ())
  flags = ["--config.model.attention_pattern=('local','global')",
           "--config.model.sliding_window=4", "--config.model.rope_pattern=('rope','nope')"]
  for path, value in sweep.parse_flags(c, flags).items():
    sweep.set_value(c, path, value)
  got = model_config(c)
  assert (got.attention_pattern, got.rope_pattern) == (("local", "global"), ("rope", "nope"))


def test_rope_ablation_interleaves_nope_layers():
  from experiments import sweep  # pylint: disable=g-import-not-at-top
  from train.spec import model_config  # pylint: disable=g-import-not-at-top
  path = "experiments/configs/rope_ablation.py"
  for arg, pattern in [("smoke,seeds=1", ("rope", "nope")),
                       ("seeds=1", ("rope", "rope", "rope", "nope"))]:
    point = next(p for p in sweep.points(path, arg) if "nope1" in p.name)
    cfg = model_config(sweep.point_config(path, arg, point))
    assert cfg.rope_pattern == pattern
    assert [cfg.layer_kind(i).rope for i in range(cfg.num_layers)] == [
        k == "rope" for k in pattern * (cfg.num_layers // len(pattern))]

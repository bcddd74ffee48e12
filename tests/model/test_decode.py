"""Decoding: the cached loop computes what the full forward computes.

Few compiles: random weights are drawn in NumPy (no init compile); the prompt
shapes of the batching test are reused by the sampling, EOS and padding tests
(sampling settings are traced, so they share one compiled loop).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import ModelConfig, Transformer
from model import decode as dec
from model.decode.cache import cache_bytes, init_cache
from model.decode.sampling import Sampling, sample
from model.transformer import abstract_variables
from train.generate import generate, pad_prompts

PROMPTS = [[5, 9, 2, 7, 1], [3, 8], [4, 6, 11, 2, 9, 13, 1]]  # Lengths 5, 2, 7.
T = 6  # New tokens.


def make_cfg(**kw):
  base = dict(vocab_size=48, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
              mlp_dim=64, max_seq_len=32, pos_encoding="rope")
  return ModelConfig(**{**base, **kw})


@functools.cache
def random_variables(cfg, seed=0):
  """Weights of O(1) effect (so greedy tokens vary), without compiling init."""
  shapes = abstract_variables(cfg)
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda s: jnp.asarray(rng.normal(0.0, 0.3, s.shape).astype(s.dtype)), shapes)


@functools.cache
def forward(cfg):
  return jax.jit(Transformer(cfg).apply)


def greedy_with_logits(cfg, variables, prompts, new_tokens):
  """Greedy prefill + decode of left-padded `prompts`: (decode's output, tokens_BT,
  logits_BTV, the padded prompt length P)."""
  tokens_BP, valid_BP = pad_prompts(prompts, cfg.vocab_size)
  P = tokens_BP.shape[1]
  cache, logits_BV, pos_B = dec.prefill(cfg, variables, tokens_BP, valid_BP,
                                        P + new_tokens - 1)
  out = dec.decode(cfg, variables, cache, logits_BV, pos_B, jax.random.key(0),
                   Sampling.make(), jnp.int32(-1), max_new_tokens=new_tokens,
                   return_logits=True)
  return out, np.asarray(out["tokens_BT"]), np.asarray(out["logits_BTV"]), P


def right_pad(rows, length):
  out = np.zeros((len(rows), length), np.int32)
  for b, r in enumerate(rows):
    out[b, :len(r)] = r
  return out


# Layer 0 dense, layer 1 MoE: two scanned segments to unstack.
MOE = dict(num_experts=4, experts_per_token=2, capacity_factor=1.0, first_k_dense=1)


# Every KV layout (4 MHA, 2 GQA, 1 MQA) and every position-dependent encoding
# (sinusoidal takes learned's code path: positions_BL -> an added [B,L,D]), at
# one compile set each; the MoE case routes with a capacity that would drop.
@pytest.mark.parametrize("num_kv_heads,pos_encoding,moe", [
    (4, "rope", False), (2, "alibi", False), (1, "learned", False), (2, "none", False),
    (1, "rope", True)])
def test_cached_greedy_and_logits_equal_full_forward(num_kv_heads, pos_encoding, moe):
  cfg = make_cfg(num_kv_heads=num_kv_heads, pos_encoding=pos_encoding, **(MOE if moe else {}))
  variables = random_variables(cfg)  # Scanned layers: decoding unrolls them.
  # The reference drops nothing either (capacity 1.0 would drop in the full forward).
  ref_cfg = cfg.replace(capacity_factor=0.0) if moe else cfg
  prompts = PROMPTS[:2]  # Different lengths: the shorter row is left-padded.
  _, gen_BT, logits_BTV, P = greedy_with_logits(cfg, variables, prompts, T)

  # Full forward (no cache) of prompt + generated, right-padded: causal, so
  # the padding after a row cannot change its logits.
  rows = [p + list(g) for p, g in zip(prompts, gen_BT)]
  full_BLV = np.asarray(forward(ref_cfg)(variables, right_pad(rows, P + T)))
  for b, p in enumerate(prompts):
    want_TV = full_BLV[b, len(p) - 1:len(p) - 1 + T]
    # Greedy recompute at every step picks argmax of the full forward's logits.
    np.testing.assert_array_equal(gen_BT[b], want_TV.argmax(-1))
    np.testing.assert_allclose(logits_BTV[b], want_TV, atol=1e-5, rtol=0)
  assert len({tuple(r) for r in gen_BT.tolist()}) == 2, "degenerate test: rows agree"


def test_batched_prompts_equal_each_prompt_alone():
  cfg = make_cfg()
  variables = random_variables(cfg)
  batched = generate(cfg, variables, PROMPTS, T)  # P = 7.
  # Alone with P = 8: every prompt gets one more pad slot than in the batch.
  alone = [generate(cfg, variables, [p], T, pad_to_multiple=8)[0] for p in PROMPTS]
  assert batched == alone
  assert all(len(r) == T for r in batched)


def test_right_padding_equals_left_padding():
  cfg = make_cfg()
  variables = random_variables(cfg)
  left_BP, valid_BP = pad_prompts(PROMPTS, cfg.vocab_size)
  right_BP = right_pad(PROMPTS, left_BP.shape[1])
  cache_len = left_BP.shape[1] + T - 1
  a = dec.prefill(cfg, variables, left_BP, valid_BP, cache_len)
  b = dec.prefill(cfg, variables, right_BP, valid_BP[:, ::-1].copy(), cache_len)
  jax.tree.map(np.testing.assert_array_equal, a, b)
  np.testing.assert_array_equal(a[2], [len(p) for p in PROMPTS])


def test_eos_stops_a_row_and_is_not_returned():
  cfg = make_cfg()
  variables = random_variables(cfg)
  greedy = generate(cfg, variables, PROMPTS, T)
  eos = greedy[0][2]
  got = generate(cfg, variables, PROMPTS, T, eos_id=eos)
  for g, r in zip(greedy, got):
    assert r == (g[:g.index(eos)] if eos in g else g)


def test_cache_is_sized_by_kv_heads_not_query_heads():
  B, S, N, H, layers = 3, 20, 8, 4, 2
  cfgs = {k: make_cfg(num_heads=N, num_kv_heads=k, num_layers=layers) for k in (8, 2, 1)}
  for k, cfg in cfgs.items():
    cache = init_cache(cfg, B, S)
    assert sorted(cache) == ["layer_0", "layer_1"]
    for layer in cache.values():
      assert layer["attn"]["cached_key"].shape == (B, S, k, H)
      assert layer["attn"]["cached_value"].shape == (B, S, k, H)
    measured = sum(x.nbytes for x in jax.tree.leaves(cache))
    assert cache_bytes(cfg, B, S) == measured
  # Only K and V grow with KV heads; segment ids, positions, index don't.
  per_head = 2 * layers * B * S * H * 4  # K and V, float32.
  assert cache_bytes(cfgs[8], B, S) - cache_bytes(cfgs[2], B, S) == 6 * per_head
  assert cache_bytes(cfgs[2], B, S) - cache_bytes(cfgs[1], B, S) == per_head


def sample_many(logits_BV, sampling, draws=300, seed=0):
  """[draws, B] tokens: the rows are tiled, and rows draw independent noise."""
  B, V = logits_BV.shape
  tiled = jnp.tile(jnp.asarray(logits_BV, jnp.float32), (draws, 1))
  tokens = jax.jit(sample)(tiled, jax.random.key(seed), sampling)  # One compile.
  return np.asarray(tokens).reshape(draws, B)


def test_top_k_never_emits_outside_the_k_best():
  logits_BV = jax.random.normal(jax.random.key(1), (4, 16)) * 3
  draws_DB = sample_many(logits_BV, Sampling.make(1.0, top_k=3))
  best_B3 = np.argsort(-np.asarray(logits_BV), axis=-1)[:, :3]
  for b in range(4):
    assert set(draws_DB[:, b]) <= set(best_B3[b])
    assert len(set(draws_DB[:, b])) > 1  # It does sample, not argmax.


def test_top_p_keeps_the_smallest_set_with_mass_p():
  # Probabilities 0.5, 0.3, 0.2 (+ ~0): mass before each is 0, 0.5, 0.8.
  probs = np.array([0.5, 0.3, 0.2] + [1e-9] * 13)
  logits_BV = jnp.asarray(np.log(np.stack([probs, probs[::-1]] * 2)), jnp.float32)
  draws_DB = sample_many(logits_BV, Sampling.make(1.0, top_p=0.6), seed=3)
  assert set(draws_DB[:, 0]) == {0, 1}
  assert set(draws_DB[:, 1]) == {15, 14}
  greedy_DB = sample_many(logits_BV, Sampling.make(0.0))
  np.testing.assert_array_equal(greedy_DB, np.broadcast_to([0, 15, 0, 15], (300, 4)))


def test_sampling_seed_and_top_p_to_zero():
  cfg = make_cfg()
  variables = random_variables(cfg)
  gen = functools.partial(generate, cfg, variables, PROMPTS, T)
  greedy = gen()
  assert gen(temperature=1.0, top_p=1e-6, seed=4) == greedy
  a, b = gen(temperature=2.0, seed=7), gen(temperature=2.0, seed=7)
  assert a == b
  assert gen(temperature=2.0, seed=8) != a
  assert gen(temperature=2.0, top_k=1, seed=9) == greedy


def test_bad_requests_fail_before_compiling():
  cfg = make_cfg(pos_encoding="learned", max_seq_len=16)
  variables = random_variables(make_cfg(pos_encoding="learned", max_seq_len=16))
  with pytest.raises(ValueError, match="max_seq_len=16"):
    generate(cfg, variables, [[1] * 10], 7)  # 10 + 7 > 16.
  for kw, field in [({"top_p": 0.0}, "top_p"), ({"temperature": -1.0}, "temperature"),
                    ({"top_k": -2}, "top_k")]:
    with pytest.raises(ValueError, match=field):
      generate(cfg, variables, [[1]], 2, **kw)
  with pytest.raises(ValueError, match="empty"):
    generate(cfg, variables, [[1], []], 2)
  with pytest.raises(ValueError, match="vocab_size"):
    generate(cfg, variables, [[48]], 2)

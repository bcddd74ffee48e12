"""Multi-head latent attention: the absorbed latent-cache decode equals the full forward,
the cache holds only latent rows, the rope key is shared (relative positions), the init
is on GQA's scale, and MLA trains sharded (tensor parallel over heads) as on one device."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import ModelConfig, Transformer
from model.attention.gqa import Attention
from model.decode.cache import kv_bytes_per_token
from model.attention.mla import MLA
from tests.model.test_decode import greedy_with_logits

PROMPTS = [[5, 9, 2, 7, 1], [3, 8]]  # Left-padded to 5.
T = 5
# Every MLA width distinct (A 16, P 4, H 8, U 12, Q 24), so a swapped axis cannot fit.
DIMS = dict(kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=12)


def make_cfg(**kw):
  base = dict(vocab_size=48, d_model=32, num_layers=2, num_heads=4, num_kv_heads=4,
              mlp_dim=64, max_seq_len=32, attention_type="mla", **DIMS)
  return ModelConfig(**{**base, **kw})


@functools.cache
def random_variables(cfg, seed=0):
  shapes = jax.eval_shape(Transformer(cfg).init, jax.random.key(0),
                          jnp.zeros((1, 4), jnp.int32))
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda s: jnp.asarray(rng.normal(0.0, 0.3, s.shape).astype(s.dtype)), shapes)


@pytest.mark.parametrize("extra", [
    dict(q_lora_rank=0),
    # A low-rank query latent, YaRN with DeepSeek's mscale on the softmax, interleaved rope.
    dict(q_lora_rank=24, rope_scaling="yarn", rope_scaling_factor=4.0,
         rope_original_max_len=8, yarn_mscale_all_dim=0.7, rope_layout="interleaved")],
    ids=["full_rank_q", "q_lora-yarn-interleaved"])
def test_absorbed_latent_decode_equals_full_forward(extra):
  cfg = make_cfg(**extra)
  variables = random_variables(cfg)
  out, gen_BT, logits_BTV, P = greedy_with_logits(cfg, variables, PROMPTS, T)
  # The cache: one [A + P] row per token and layer, no per-head keys or values.
  for layer in out["cache"].values():
    assert sorted(layer["attn"]) == ["cached_latent", "index", "positions", "segment_ids"]
    assert layer["attn"]["cached_latent"].shape == (2, P + T - 1, 16 + 4)

  for b, p in enumerate(PROMPTS):  # The expanded (training) path, no cache.
    full_LV = np.asarray(Transformer(cfg).apply(variables, np.asarray([p + list(gen_BT[b])])))[0]
    want_TV = full_LV[len(p) - 1:len(p) - 1 + T]
    np.testing.assert_allclose(logits_BTV[b], want_TV, atol=2e-5, rtol=0)  # Seen: 1.3e-6.
    np.testing.assert_array_equal(gen_BT[b], want_TV.argmax(-1))
  assert np.abs(logits_BTV).max() > 1.0  # O(1) logits: the comparison has teeth.


def test_shared_rope_key_sees_relative_positions_only():
  cfg = make_cfg()
  variables = random_variables(cfg)
  toks_BL = np.asarray([[1, 4, 9, 16, 25, 36, 2, 3]])
  pos_BL = np.arange(8)[None]
  f = jax.jit(lambda pos: Transformer(cfg).apply(variables, toks_BL, positions_BL=pos))
  a, b = np.asarray(f(pos_BL)), np.asarray(f(pos_BL + 7))
  np.testing.assert_allclose(a, b, atol=1e-4)
  no_rope = np.asarray(Transformer(cfg.replace(pos_encoding="none")).apply(variables, toks_BL))
  assert np.abs(a - no_rope).max() > 1e-2  # The rope dims do carry position.


def test_kv_bytes_per_token_counts_latent_rows_on_the_gqa_axis():
  cfg = make_cfg(num_layers=3)
  assert kv_bytes_per_token(cfg) == 3 * (16 + 4) * 4  # Layers x (A + P) x float32.
  assert kv_bytes_per_token(cfg.replace(num_heads=8, num_kv_heads=8)) == 3 * 20 * 4
  gqa = make_cfg(num_layers=3, attention_type="gqa", num_kv_heads=2)
  assert kv_bytes_per_token(gqa) == 3 * 2 * 2 * 8 * 4  # Layers x (K, V) x K x H x float32.
  assert kv_bytes_per_token(cfg.replace(dtype="bfloat16")) == 3 * 20 * 2


def test_init_output_scale_matches_gqa():
  """The latent up-projections start at GQA's q/k/v scale (not sqrt(rank/D) off): with
  small ranks the attention output RMS at init stays within 30% of GQA's."""
  x_BLD = jax.random.normal(jax.random.key(1), (4, 16, 64))
  pos_BL, seg_BL = jnp.broadcast_to(jnp.arange(16), (4, 16)), jnp.ones((4, 16), jnp.int32)
  base = dict(vocab_size=8, d_model=64, num_layers=1, num_heads=4, num_kv_heads=4, mlp_dim=8,
              max_seq_len=16)
  rms = lambda m: float(jnp.sqrt(jnp.mean(jnp.square(
      m.apply(m.init(jax.random.key(0), x_BLD, pos_BL, seg_BL), x_BLD, pos_BL, seg_BL)))))
  gqa = rms(Attention(ModelConfig(**base)))
  mla = rms(MLA(ModelConfig(**base, attention_type="mla", q_lora_rank=16, kv_lora_rank=16)))
  assert 0.7 < mla / gqa < 1.3, (mla, gqa)


def test_invalid_mla_configs_name_the_field():
  with pytest.raises(ValueError, match="num_kv_heads"):
    make_cfg(num_kv_heads=2)
  with pytest.raises(ValueError, match="qk_rope_head_dim"):
    make_cfg(qk_rope_head_dim=3)
  with pytest.raises(ValueError, match="sliding_window"):
    make_cfg(sliding_window=4)
  with pytest.raises(ValueError, match="yarn_mscale_all_dim"):
    ModelConfig(vocab_size=8, d_model=8, num_layers=1, num_heads=2, num_kv_heads=2, mlp_dim=8,
                max_seq_len=8, yarn_mscale_all_dim=1.0)


def test_mla_shards_heads_over_tensor_and_trains_like_one_device(tmp_path):
  """data 2 x fsdp 2 x tensor 2, scanned and rematerialised, through the training loop:
  per-step losses equal the one-device pure step; the up-projections split by head."""
  from parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  from parallel import rules as rules_lib  # pylint: disable=g-import-not-at-top
  from parallel.sharding import abstract_shardings  # pylint: disable=g-import-not-at-top
  from tests.parallel import test_train_equivalence as eq  # pylint: disable=g-import-not-at-top
  from train import loop  # pylint: disable=g-import-not-at-top

  def mla(c):
    c.model.update(attention_type="mla", q_lora_rank=16, kv_lora_rank=16, remat="full")
    return c

  steps = 3
  c = mla(eq.config({"data": 2, "fsdp": 2, "tensor": 2}, steps=steps))
  mesh = mesh_lib.make_mesh(c.mesh)
  rules = rules_lib.logical_rules(mesh=mesh, num_heads=c.model.num_heads,
                                  num_kv_heads=c.model.num_kv_heads)
  from train.spec import model_config  # pylint: disable=g-import-not-at-top
  cfg = model_config(c)  # The tokenizer's vocabulary when model.vocab_size is unset.
  _, shardings = abstract_shardings(Transformer(cfg).init, jax.random.key(0),
                                    jnp.zeros((1, 4), jnp.int32), mesh=mesh, rules=rules)
  attn = shardings["params"]["layers"]["attn"]
  # layers, latent (fsdp: the up-projections are not replicated), heads (tensor), H.
  assert tuple(attn["k_up"]["w"].spec) == (None, "fsdp", "tensor", None)
  assert tuple(attn["kv_a"]["w"].spec) == (None, "fsdp", None)  # layers, embed, latent.

  loop.run(c, str(tmp_path))
  got = eq.train_records(tmp_path)
  want, _ = eq.one_device_run(mla(eq.config({}, steps=steps)), steps)
  np.testing.assert_allclose([r["loss"] for r in got], [float(w["loss"]) for w in want],
                             **eq.LOSS_TOL)
  assert got[0]["loss"] > got[-1]["loss"]


def test_gqa_ablation_mla_points_sit_at_their_gqa_points_kv_bytes():
  """`gqa_ablation.py:mla=1` adds MLA beside kv<K> at the same KV bytes per token, as the
  report (experiments/report/runs.py, the decode cache's own formula) counts them."""
  import json  # pylint: disable=g-import-not-at-top
  from experiments import report  # pylint: disable=g-import-not-at-top
  from experiments.configs import gqa_ablation  # pylint: disable=g-import-not-at-top
  c = gqa_ablation.get_config("mla=1,seeds=1")
  kv = {}
  for point in gqa_ablation.sweep("mla=1,seeds=1"):
    # As config.json records it: model.vocab_size resolved (the byte tokenizer's).
    model = {**dict(c.model), "vocab_size": 256,
             **{k[6:]: v for k, v in point.items() if k.startswith("model.")}}
    kv[point["name"]] = report._model_sizes(json.dumps(model, default=list))[2]
  mla = [n for n in kv if n.startswith("mla-")]
  assert mla == ["mla-kv2-s0", "mla-kv1-s0"]  # kv4's latent would be wider than d_model.
  for name in mla:
    assert kv[name] == kv[name[4:]] > 0


def test_blockwise_attention_serves_mla_as_the_reference():
  """Values wider than a query / key head (U = 16 > H + P = 12: q and k zero-padded to 16)
  run through the blockwise (flash-style) implementation as through the reference."""
  cfg = make_cfg(v_head_dim=16, attention_impl="xla")
  variables = random_variables(cfg)
  toks_BL = np.asarray([[1, 4, 9, 16, 25, 36, 2, 3, 7, 7, 1, 0, 5, 6, 8, 9]])
  ref = np.asarray(Transformer(cfg).apply(variables, toks_BL))
  blocked = cfg.replace(attention_impl="blockwise", attention_block_q=8, attention_block_kv=8)
  np.testing.assert_allclose(np.asarray(Transformer(blocked).apply(variables, toks_BL)), ref,
                             atol=1e-4)


@pytest.mark.parametrize("q_lora_rank", [0, 24])
def test_flops_count_every_mla_projection(q_lora_rank):
  """MFU's active parameters: the attention's matmul weights are exactly its projections
  (norm scales excluded); a (query, key) pair costs 2 N (H + P + U) forward FLOPs."""
  from model import flops  # pylint: disable=g-import-not-at-top
  cfg = make_cfg(q_lora_rank=q_lora_rank, num_layers=1)
  shapes = jax.eval_shape(Transformer(cfg).init, jax.random.key(0),
                          jnp.zeros((1, 4), jnp.int32))["params"]["layers"]["attn"]
  weights = sum(int(np.prod(v["w"].value.shape)) for v in shapes.values() if "w" in v)
  gqa = cfg.replace(attention_type="gqa")
  assert (flops.matmul_params_per_token(cfg) - flops.matmul_params_per_token(gqa)
          == weights - flops._attention_params(gqa))
  L = 16
  attn = flops.training_flops_per_token(cfg, L) - 6 * flops.matmul_params_per_token(cfg)
  assert attn == pytest.approx(6 * 4 * (8 + 4 + 12) * (L + 1) / 2)

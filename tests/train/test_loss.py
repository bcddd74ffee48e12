"""The vocabulary-tiled loss (train/loss.py) equals the loss over the full logits: per
token, in gradient, on 8 devices, and through launch.py, where the chunking is an
operational field a resume may change."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from model import ModelConfig, Transformer
from parallel import logical_rules, make_mesh, mesh_context
from tests.cli import launch
from tests.losses import loss_mismatches, run_losses
from train import load_run
from train.loss import auto_chunks, chunk_probe, resolve_chunks, token_losses

B, L = 4, 12


def _cfg(**kw):
  return ModelConfig(vocab_size=97, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2,
                     mlp_dim=64, max_seq_len=L, **kw)


@functools.cache
def _model(tied: bool):
  cfg = _cfg(tie_embeddings=tied)
  k1, k2 = jax.random.split(jax.random.key(0))
  tokens_BL = jax.random.randint(k1, (B, L), 0, cfg.vocab_size)
  targets_BL = jax.random.randint(k2, (B, L), 0, cfg.vocab_size)
  params = Transformer(cfg).init(jax.random.key(1), tokens_BL)["params"]
  # Sharper logits than at init, so ties and tiny differences cannot hide a wrong target.
  params = jax.tree.map(lambda p: p * 3.0, params)
  return cfg, params, tokens_BL, targets_BL


@pytest.fixture(params=[False, True], ids=["untied", "tied"])
def model(request):
  return _model(request.param)


def _far(got, want, atol: float = 2e-6) -> list[str]:
  """The leaves not equal to float32 rounding at each leaf's scale (max |want|)."""
  out = []
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    scale = float(np.max(np.abs(w))) + 1e-6
    err = float(np.max(np.abs(np.asarray(g) - np.asarray(w)))) / scale
    if not err <= atol:
      out.append(f"{jax.tree_util.keystr(path)}: {err:.2e} of its scale")
  return out


def _full(cfg, params, tokens_BL, targets_BL):
  logits_BLV = Transformer(cfg).apply({"params": params}, tokens_BL)
  ce_BL = optax.softmax_cross_entropy_with_integer_labels(logits_BLV, targets_BL)
  return ce_BL, logits_BLV


def _tiled(cfg, params, tokens_BL, targets_BL, chunks):
  hidden_BLD = Transformer(cfg).apply({"params": params}, tokens_BL, return_hidden=True)
  return token_losses(cfg, params, hidden_BLD, targets_BL, chunks)


@pytest.mark.parametrize("chunks", [1, 4, 5, "auto"])  # 5 does not divide L: padded.
def test_token_losses_equal_the_full_logits(model, chunks):
  cfg, params, tokens_BL, targets_BL = model
  ce_BL, logits_BLV = _full(*model)
  got = jax.jit(_tiled, static_argnums=(0, 4))(cfg, params, tokens_BL, targets_BL, chunks)
  np.testing.assert_allclose(got.ce_BL, ce_BL, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(got.logz_BL, jax.nn.logsumexp(logits_BLV, -1), rtol=1e-6)
  np.testing.assert_array_equal(got.correct_BL, jnp.argmax(logits_BLV, -1) == targets_BL)
  assert 0 < float(got.correct_BL.mean()) < 1  # Both outcomes occur: the test can tell.
  np.testing.assert_allclose(got.max_logit_BL, logits_BLV.max(-1), rtol=1e-6)
  np.testing.assert_allclose(got.mean_logit_BL, logits_BLV.mean(-1), rtol=1e-5, atol=1e-6)


def test_gradients_equal_the_full_logits(model):
  cfg, params, tokens_BL, targets_BL = model
  w_BL = (jnp.arange(L) % 3 != 0).astype(jnp.float32)[None].repeat(B, 0)
  full = lambda p: jnp.sum(_full(cfg, p, tokens_BL, targets_BL)[0] * w_BL)
  tiled = lambda p: jnp.sum(_tiled(cfg, p, tokens_BL, targets_BL, 4).ce_BL * w_BL)
  assert not _far(jax.jit(jax.grad(tiled))(params), jax.jit(jax.grad(full))(params))


def test_chunk_probes_recover_every_chunks_cost_from_the_scanned_count(model):
  """XLA's cost analysis counts a loop body once: the scanned loss's FLOPs fall with the
  chunks. The roofline's probes (train/aot/compile.py) compile at n and 2n chunks under
  chunk_probe and take n chunks' cost as b(T/n) + 2 (n - 1) (b(T/n) - b(T/2n)): at
  least the one-chunk loss's FLOPs (each chunk's logits are recomputed in the backward),
  not a fraction of them."""
  cfg, params, tokens_BL, targets_BL = model

  def flops(chunks: int, scale: int = 1) -> float:
    loss = lambda p: jnp.sum(_tiled(cfg, p, tokens_BL, targets_BL, chunks).ce_BL)
    with chunk_probe(scale) as seen:
      f = jax.jit(jax.grad(loss)).lower(params).compile().cost_analysis()["flops"]
    assert seen == ([] if chunks == 1 else [chunks])
    return f

  # 3 and 6 chunks divide L = 12: no padding tokens (which the pod's lengths never need).
  one, scanned, doubled = flops(1), flops(3), flops(3, scale=2)
  estimate = scanned + 2 * (3 - 1) * (scanned - doubled)
  assert doubled < scanned < one <= estimate < 1.5 * one, (one, scanned, doubled, estimate)


def test_sharded_over_fsdp_and_tensor_equals_one_device():
  """On 8 devices (data 2 x fsdp 2 x tensor 2: the batch split, the tied table's D over
  fsdp and its vocabulary over tensor) the loss and its gradient are one device's."""
  cfg, params, tokens_BL, targets_BL = _model(True)
  loss = lambda p: jnp.sum(_tiled(cfg, p, tokens_BL, targets_BL, 3).ce_BL)
  want = jax.jit(jax.value_and_grad(loss))(params)
  mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  with mesh_context(mesh, logical_rules(mesh=mesh)):
    got = jax.jit(jax.value_and_grad(loss))(params)
  assert not _far(got, want)


def test_auto_sizes_chunks_from_the_vocabulary_and_tokens_per_chip():
  # The 1b preset's 8 x 4096 tokens per chip at vocab 128,256: 16 GiB of logits -> 63.
  assert auto_chunks(128_256, 16 * 8 * 4096, {"fsdp": 16}) == 63
  assert auto_chunks(128_256, 16 * 8 * 4096, {"fsdp": 8, "tensor": 2}) == 63
  assert auto_chunks(256, 64) == 1  # Small logits: one chunk, no scan.
  assert resolve_chunks(_cfg(loss_chunks=50), B, L) == L  # Never more chunks than tokens.
  assert _cfg(loss_chunks="4").loss_chunks == 4  # A command-line override is a string.
  with pytest.raises(ValueError, match="ModelConfig.loss_chunks=0"):
    _cfg(loss_chunks=0)


FAST = ("--config.train.async_checkpoint=False", "--config.train.tensorboard=False",
        "--config.train.log_every=1", "--config.train.eval_every=2")


def test_launch_trains_the_same_with_any_chunking_and_resumes_with_another(tmp_path):
  one, four = tmp_path / "one", tmp_path / "four"
  launch("--workdir", str(one), *FAST, "--config.train.steps=2", "--config.model.loss_chunks=1")
  launch("--workdir", str(four), *FAST, "--config.train.steps=2", "--config.model.loss_chunks=4")
  assert not loss_mismatches(run_losses(one), run_losses(four), rtol=2e-6)
  # A resume with another chunking needs no --allow_config_change; it is on the record.
  launch("--workdir", str(one), *FAST, "--config.train.steps=3", "--config.model.loss_chunks=4")
  run = load_run(str(one))
  assert run.step == 3
  changes = {c["field"]: (c["step"], c["old"], c["new"]) for c in run.config_changes}
  assert changes["model.loss_chunks"][0] == 2
  assert json.dumps(changes["model.loss_chunks"][1:]) in ('["1", "4"]', '[1, 4]')

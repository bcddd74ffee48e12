"""Context parallelism: ring attention == the reference, and training over mesh.context
(through launch.py) == one device, resumable on another context size, refusals by name.

The training runs use a corpus of short text files, so every 64-token window packs
several documents (segment ids and restarting positions); RoPE throughout. "mha_window"
is MHA with a sliding-window layer (pattern local, global), "gqa" is GQA (2 KV heads of 4).
"""

import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from model import Transformer
from model.attention.reference import AttnData, AttnSpec, xla_attention
from model.attention.ring import ring_attention
from parallel import batch_sharding, context, logical_rules, make_mesh, mesh_context
from tests.cli import launch
from tests.parallel.test_train_equivalence import one_device_run
from train import load_run
from train.data.pipeline import make_source
from train.metrics import read_metrics

P = jax.sharding.PartitionSpec
STEPS, SEQ = 10, 64
MODELS = {  # name: launch.py model overrides (on tiny.py:smoke, MHA with RoPE).
    "mha_window": ("--config.model.attention_pattern=('local', 'global')",
                   "--config.model.sliding_window=12"),
    "gqa": ("--config.model.num_kv_heads=2",),
}
MESHES = {"context8": {"data": 1, "context": 8}, "data2_context4": {"data": 2, "context": 4}}
# Each model on one of the meshes (every pairing costs a run's compiles; the ring's code
# is the same for both models, the meshes differ in their data axis and ring size).
CASES = [("mha_window", "context8"), ("gqa", "data2_context4")]
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)  # As tests/parallel/test_train_equivalence.py.
PARAM_TOL = dict(rtol=1e-4, atol=2e-5)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """60 short documents (one per file): each training window holds several."""
  root = tmp_path_factory.mktemp("docs")
  rng = np.random.default_rng(0)
  words = ["to", "be", "or", "not", "the", "question", "whether", "tis", "nobler", "mind"]
  for i in range(60):
    text = " ".join(rng.choice(words, size=rng.integers(4, 12)))
    (root / f"doc{i:02d}.txt").write_text(text + "\n")
  return str(root)


def flags(corpus, model, mesh, steps=STEPS):
  return ("--config.data.corpus=" + corpus, f"--config.data.seq_len={SEQ}",
          f"--config.train.steps={steps}", "--config.train.log_every=1",
          "--config.train.schedule=constant", "--config.train.warmup_steps=0",
          "--config.train.checkpoint_every=5", "--config.train.async_checkpoint=False",
          "--config.train.tensorboard=False", "--config.eval.batches=1",
          *(f"--config.mesh.{axis}={size}" for axis, size in mesh.items()), *MODELS[model])


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
  """(model, mesh) -> workdir of a STEPS-step launch.py run, each run at most once."""
  done = {}

  def get(model, mesh):
    if (model, mesh) not in done:
      workdir = tmp_path_factory.mktemp(f"{model}_{mesh}")
      launch("--workdir", str(workdir), *flags(corpus, model, MESHES[mesh]))
      done[model, mesh] = workdir
    return done[model, mesh]

  return get


@pytest.fixture(scope="module")
def references(runs):
  """model -> the same config's pure train step on one device: (metrics, final params)."""
  done = {}

  def get(model):
    if model not in done:
      workdir = runs(*next(case for case in CASES if case[0] == model))
      done[model] = one_device_run(load_run(str(workdir)).config, STEPS)
    return done[model]

  return get


def train_records(workdir):
  return [r for r in read_metrics(workdir) if r["split"] == "train"]


@pytest.mark.parametrize("model, mesh", CASES)
def test_context_parallel_training_matches_one_device(model, mesh, runs, references):
  want_records, want_params = references(model)
  workdir = runs(model, mesh)
  record = json.load(open(os.path.join(workdir, "config.json")))
  assert record["mesh"]["context"] == MESHES[mesh]["context"]
  assert record["_run"]["attention_impl"] == {str(SEQ): "ring"}  # What "auto" ran.
  got = train_records(workdir)
  assert [r["step"] for r in got] == list(range(1, STEPS + 1))
  for key in ("loss", "grad_norm", "param_norm"):
    np.testing.assert_allclose([r[key] for r in got], [float(w[key]) for w in want_records],
                               **LOSS_TOL, err_msg=f"{model} on {mesh}: {key} per step")
  assert got[0]["loss"] > got[-1]["loss"] + 1e-2  # It trains, so the check has teeth.
  params = jax.tree.map(np.asarray, load_run(str(workdir)).variables["params"])
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(params),
                          jax.tree.leaves(want_params)):
    np.testing.assert_allclose(g, w, **PARAM_TOL, err_msg=f"{model} on {mesh}: "
                               f"{jax.tree_util.keystr(path)}")


def test_one_step_gradients_equal_one_device(runs):
  """Loss gradients of the trained parameters on the first batch: context=8 (the run's
  mesh, rules and batch sharding) == one device, for the windowed MHA model."""
  run = load_run(str(runs("mha_window", "context8")))
  c, model_cfg = run.config, run.model_config
  params = jax.tree.map(np.asarray, run.variables["params"])  # Host arrays: no device yet.
  net = Transformer(model_cfg)
  batch = next(make_source(c.data, None).train_iterator(int(c.train.seed), c.data.batch_size,
                                                        c.data.seq_len))

  def loss(params, batch):
    logits_BLV = net.apply({"params": params}, batch["inputs"], batch["positions"],
                           batch["segment_ids"])
    ce_BL = optax.softmax_cross_entropy_with_integer_labels(logits_BLV, batch["targets"])
    return jnp.sum(ce_BL * batch["weights"]) / jnp.sum(batch["weights"])

  want = jax.jit(jax.grad(loss))(params, batch)
  mesh = make_mesh(c.mesh)
  rules = logical_rules(mesh=mesh, num_kv_heads=model_cfg.num_kv_heads,
                        num_heads=model_cfg.num_heads)
  with mesh_context(mesh, rules):
    got = jax.jit(jax.grad(loss), in_shardings=(None, batch_sharding(mesh, rules)))(params, batch)
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))


def test_resume_from_context4_on_context1(runs, corpus, tmp_path):
  """The data=2 x context=4 run's step-5 checkpoint (its later one removed), resumed with
  data=8 (no context): the same run as the uninterrupted data=2 x context=4 one."""
  straight = runs("gqa", "data2_context4")
  shutil.copytree(straight, tmp_path, dirs_exist_ok=True)
  shutil.rmtree(tmp_path / "checkpoints" / str(STEPS))
  assert load_run(str(tmp_path)).step == 5
  launch("--workdir", str(tmp_path), *flags(corpus, "gqa", {"data": 8, "context": 1}))
  got, want = train_records(tmp_path), train_records(straight)
  assert [r["step"] for r in got] == list(range(1, STEPS + 1))
  for key in ("loss", "grad_norm"):
    np.testing.assert_allclose([r[key] for r in got], [r[key] for r in want], **LOSS_TOL,
                               err_msg=f"resumed on context=1: {key} per step")


def test_ring_attention_equals_reference_with_every_feature():
  """Forward and gradients of the ring on 8 devices (data=2 x context=4) against the
  reference: GQA, packed segments, positions for ALiBi, sliding window, soft-cap."""
  B, L, K, G, H = 2, 64, 2, 2, 8
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(kq, (B, L, K, G, H))
  k, v = jax.random.normal(kk, (B, L, K, H)), jax.random.normal(kv, (B, L, K, H))
  seg = jnp.asarray(np.cumsum(np.random.default_rng(0).random((B, L)) < 0.1, 1) + 1, jnp.int32)
  pos = jnp.asarray(np.arange(L) - np.maximum.accumulate(
      np.where(np.diff(seg, prepend=0) > 0, np.arange(L), 0), axis=1), jnp.int32)
  data = AttnData(seg, seg, pos, pos)
  spec = AttnSpec(scale=H ** -0.5, softcap=5.0, sliding_window=12, alibi=True)

  def value_and_grads(attn):
    def loss(q, k, v):
      out = attn(q, k, v, data, spec)
      return jnp.sum(jnp.sin(out)), out
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))

  (_, want_out), want_grads = value_and_grads(xla_attention)(q, k, v)
  mesh = make_mesh({"data": 2, "context": 4})
  sharding = jax.sharding.NamedSharding(mesh, P("data", "context"))
  def ring(q, k, v, data, spec):  # The network's zig-zag order, set and undone around it.
    q, k, v, data = context.to_zigzag_layout((q, k, v, data))
    return context.from_zigzag_layout(ring_attention(q, k, v, data, spec))

  with mesh_context(mesh, logical_rules(mesh=mesh)):
    (_, out), grads = value_and_grads(ring)(
        *(jax.device_put(x, sharding) for x in (q, k, v)))
  np.testing.assert_allclose(out, want_out, atol=2e-6)
  for name, g, w in zip("qkv", grads, want_grads):
    np.testing.assert_allclose(g, w, atol=5e-6, err_msg=f"d{name}")


@pytest.mark.parametrize("args, words", [
    (("--config.mesh.context=8", "--config.model.attention_impl=xla"),
     ["model.attention_impl='xla'", "ring"]),
    (("--config.mesh.context=8", "--config.data.seq_len=40"),
     ["data.seq_len=40", "2 * mesh.context = 16"]),
    (("--config.mesh.context=8", "--config.eval.context_lengths=(1, 0.75)"),
     ["eval.context_lengths", "[32, 24]", "2 * mesh.context = 16"]),
    (("--config.mesh.context=8", "--config.eval.tasks=passkey"),
     ["eval.tasks='passkey'", "mesh.context=8"]),
])
def test_unsupported_context_parallel_configs_are_refused_by_name(args, words, tmp_path):
  with pytest.raises(ValueError) as err:
    launch("--workdir", str(tmp_path / "run"), "--config.mesh.data=1", *args)
  for word in words:
    assert word in str(err.value), (word, str(err.value))
  assert not (tmp_path / "run").exists()  # Refused before the run directory is touched.


@pytest.mark.parametrize("c", [2, 4, 8])
def test_zigzag_layout_balances_the_causal_work(c):
  """Visible (unskipped) block pairs per device at every ring step: equal on every device
  (a contiguous layout would give device c-1 all of them and device 0 one in c steps),
  and together they cover each causal pair of chunks once."""
  from model.attention import ring as ring_lib  # pylint: disable=g-import-not-at-top
  ring, block = ring_lib.Ring(size=c, chunk=4), 4
  spec = AttnSpec(scale=1.0, block_q=block, block_kv=block)
  seen = set()
  for step in range(c):
    counts = []
    for me in range(c):
      src = (me - step) % c
      slots = lambda dev: [int(ring_lib._block_slot(ring, dev, i, block)) for i in range(2)]
      pairs = [(q0, k0) for q0 in slots(me) for k0 in slots(src)
               if ring_lib._visible(spec, q0, k0)]
      counts.append(len(pairs))
      seen.update(pairs)
    assert len(set(counts)) == 1, (step, counts)
  assert seen == {(4 * i, 4 * j) for i in range(2 * c) for j in range(i + 1)}


def test_the_ring_moves_only_key_value_blocks():
  """Ring attention on inputs in the network's zig-zag order (context=4): every
  collective-permute of the compiled forward + backward moves at most a K/V block (the
  queries are 4x K/V here, so even half a device's queries would be larger): the queries,
  the output and their gradients never move, so no layer holds copies of its activations
  in another order."""
  B, L, K, G, H = 1, 64, 2, 4, 8
  shapes = [(B, L, K, G, H), (B, L, K, H), (B, L, K, H)]
  spec = AttnSpec(scale=H ** -0.5)
  mesh = make_mesh({"context": 4}, devices=jax.devices()[:4])

  def loss(q, k, v):
    ids = jnp.ones((B, L), jnp.int32)
    pos = context.to_zigzag_layout(jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L)))
    return jnp.sum(ring_attention(q, k, v, AttnData(ids, ids, pos, pos), spec))

  sharding = jax.sharding.NamedSharding(mesh, P(None, "context"))
  with mesh_context(mesh, logical_rules(mesh=mesh)):
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), in_shardings=(sharding,) * 3).lower(
        *(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes)).compile().as_text()
  moved = [int(np.prod([int(d) for d in dims.split(",") if d]))
           for line in hlo.splitlines() if " collective-permute" in line
           for dims in re.findall(r"\b[fs]32\[([0-9,]*)\]", line.split("collective-permute")[0])]
  assert moved, "the ring passes K/V blocks with collective-permutes"
  assert max(moved) <= B * (L // 4) * K * H, sorted(set(moved))

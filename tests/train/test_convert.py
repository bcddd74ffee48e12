"""MHA -> GQA / MQA conversion (GQA paper, section 2.1) through `launch.py --mode convert`,
then uptraining: continuing the converted run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import Transformer
from tests.cli import launch
from train import load_run
from train.metrics import read_metrics


FAST = ("--config.train.async_checkpoint=False", "--config.train.tensorboard=False",
        "--config.train.log_every=1", "--config.train.eval_every=4",
        "--config.train.checkpoint_every=4")


@pytest.fixture(scope="module")
def mha(tmp_path_factory):
  """A 4-step MHA run (4 heads, 4 KV heads)."""
  workdir = tmp_path_factory.mktemp("mha") / "run"
  launch("--workdir", str(workdir), *FAST, "--config.train.steps=4",
         "--config.model.num_kv_heads=4")
  return workdir


def convert(src, dst, *flags):
  return launch("--mode", "convert", "--from_run", str(src), "--workdir", str(dst), *flags)


def kv_kernels(run):
  attn = run.variables["params"]["layers"]["attn"]  # Scanned: [layers, D, K, H].
  return np.asarray(attn["k"]["w"]), np.asarray(attn["v"]["w"])


def logits(run, tokens_BL):
  # Jitted: one compile per model shape, not one per op of an eager forward.
  return np.asarray(jax.jit(Transformer(run.model_config).apply)(run.variables, tokens_BL))


def test_same_kv_heads_is_the_identity(mha, tmp_path):
  convert(mha, tmp_path / "k4", "--config.model.num_kv_heads=4")
  src, dst = load_run(str(mha)), load_run(str(tmp_path / "k4"))
  tokens_BL = jnp.arange(32, dtype=jnp.int32)[None] % 256
  np.testing.assert_array_equal(logits(dst, tokens_BL), logits(src, tokens_BL))
  assert dst.step == 0


@pytest.mark.parametrize("k,method", [(2, "mean"), (1, "mean"), (2, "first")])
def test_kv_heads_pool_each_group(mha, tmp_path, k, method):
  out = convert(mha, tmp_path / "dst", f"--config.model.num_kv_heads={k}",
                f"--convert_method={method}")
  assert "converted" in out
  src, dst = load_run(str(mha)), load_run(str(tmp_path / "dst"))
  assert dst.model_config.num_kv_heads == k and dst.step == 0
  for old, new in zip(kv_kernels(src), kv_kernels(dst)):
    groups = old.reshape(old.shape[:2] + (k, 4 // k) + old.shape[3:])
    want = groups.mean(3) if method == "mean" else groups[:, :, :, 0]
    np.testing.assert_allclose(new, want, rtol=1e-6)
  q_src = np.asarray(src.variables["params"]["layers"]["attn"]["q"]["w"])
  np.testing.assert_array_equal(np.asarray(dst.variables["params"]["layers"]["attn"]["q"]["w"]),
                                q_src)  # Every other weight is copied.


def test_refusals_name_the_problem(mha, tmp_path):
  with pytest.raises(ValueError, match="num_kv_heads=3: must divide"):
    convert(mha, tmp_path / "k3", "--config.model.num_kv_heads=3")
  with pytest.raises(ValueError, match="changes only model.num_kv_heads"):
    convert(mha, tmp_path / "wide", "--config.model.d_model=64")
  assert not (tmp_path / "k3").exists() and not (tmp_path / "wide").exists()
  with pytest.raises(FileExistsError, match="already holds a run"):
    convert(mha, mha, "--config.model.num_kv_heads=2")


def test_uptraining_continues_the_converted_run(mha, tmp_path):
  dst = tmp_path / "gqa2"
  convert(mha, dst, "--config.model.num_kv_heads=2")
  launch("--config", f"experiments/configs/from_run.py:{dst}", "--workdir", str(dst), *FAST,
         "--config.train.steps=2", "--config.train.warmup_steps=0", "--config.train.lr=0.001")
  run = load_run(str(dst))
  assert run.step == 2 and run.model_config.num_kv_heads == 2
  assert [r["step"] for r in read_metrics(dst) if r["split"] == "train"] == [1, 2]
  changed = {c["field"]: c["new"] for c in run.config_changes}
  assert changed["train.steps"] == 2 and changed["train.lr"] == 0.001  # Recorded at step 0.


def test_gqa_ablation_uptrains_and_reports_side_by_side(tmp_path):
  """uptrain=α: MHA trained once per seed, converted to every K, evaluated before and
  after uptraining; the report has all three kinds of row with their tokens."""
  from experiments import report  # pylint: disable=g-import-not-at-top
  out = launch("--config", "experiments/configs/gqa_ablation.py:smoke,seeds=1,steps=4,uptrain=0.5",
               "--workdir", str(tmp_path), "--sweep", *FAST[:2])  # 4 steps, then 2.
  assert "failed" not in out
  _, rows, _ = report.collect(str(tmp_path))
  by_run = {r["run"]: r for r in rows}
  for k in (2, 1):
    scratch, conv, up = by_run[f"kv{k}-s0"], by_run[f"kv{k}-conv-s0"], by_run[f"kv{k}-up-s0"]
    assert all(r["status"] == "finished" for r in (scratch, conv, up))
    assert conv["kv_bytes_per_token"] == up["kv_bytes_per_token"] == scratch["kv_bytes_per_token"]
    assert up["tokens"] == scratch["tokens"] + 2 * 8 * 32  # 4 MHA steps + 2 uptraining.
    assert conv["tokens"] == scratch["tokens"]  # The MHA run's, evaluated after conversion.
    assert up["final_loss"] != conv["final_loss"]

"""Loss spikes through launch.py (train/spikes.py): a poisoned data window
(data.test_poison, test-only) makes exactly one spike; skip_batch drops its update,
rollback restores the last checkpoint and skips the window, both recorded in
RUN/spikes.jsonl, and a run resumed from that checkpoint after the rollback (the
attempt died before its next checkpoint) skips the same window: its parameters equal
the uninterrupted run's."""

import json
import shutil

import jax
import numpy as np

from tests.cli import launch
from train.metrics import read_metrics
from train.spikes import read_spikes


# lr 0.01 trains the smoke model from 6.1 to ~4.1 by step 11; the poisoned batch (position
# 11: step 12's) then scores ~6.8, 1.5x the median of the 4 steps before it.
ARGS = ("--config.train.async_checkpoint=False", "--config.train.tensorboard=False",
        "--config.train.log_every=1", "--config.train.eval_every=100",
        "--config.train.lr=0.01", "--config.train.spike_window=4",
        "--config.train.spike_threshold=1.3", "--config.data.test_poison=(11, 1)")


def _train_lines(workdir):
  return {r["step"]: r for r in read_metrics(str(workdir)) if r.get("split") == "train"}


def test_skip_batch_drops_the_poisoned_update_once_and_records_it(tmp_path):
  launch("--workdir", str(tmp_path), *ARGS, "--config.train.on_spike=skip_batch",
         "--config.train.steps=13", "--config.train.checkpoint_every=100")
  [spike] = read_spikes(str(tmp_path))
  assert spike["step"] == 12 and spike["action"] == "update skipped"
  assert spike["ratio"] > 1.3 and spike["moved_most"]["key"].startswith("telemetry/")
  lines = _train_lines(tmp_path)
  assert [s for s, r in lines.items() if r["spike"]] == [12]
  assert lines[12]["param_norm"] == lines[11]["param_norm"]  # Not applied...
  assert lines[13]["param_norm"] != lines[12]["param_norm"]  # ...and training goes on.


def test_rollback_skips_the_window_once_and_a_resume_from_its_checkpoint_is_exact(tmp_path):
  a = tmp_path
  roll = (*ARGS, "--config.train.on_spike=rollback", "--config.train.checkpoint_every=10")
  launch("--workdir", str(a), *roll, "--config.train.steps=14")
  [spike] = read_spikes(str(a))
  assert (spike["step"], spike["to_step"], spike["skip_batches"]) == (12, 10, 2)
  assert sorted(_train_lines(a)) == list(range(1, 15))  # Each step once in metrics.jsonl,
  rewound = [json.loads(l) for l in open(a / "metrics.rewound.jsonl")]
  assert {r["step"] for r in rewound if r["split"] == "train"} == {11, 12}  # the undone kept.
  assert not any(r["spike"] for r in _train_lines(a).values() if r["step"] > 10)

  # The run dies after its rollback, before its next checkpoint (14 is lost): resumed
  # from checkpoint 10, it must skip the same window again, from spikes.jsonl, and log
  # exactly what the attempt after the rollback logged (now in metrics.rewound.jsonl).
  shutil.rmtree(a / "checkpoints" / "14")
  launch("--workdir", str(a), *roll, "--config.train.steps=14")
  assert len(read_spikes(str(a))) == 1  # The spike did not come back.
  before = {}
  for line in open(a / "metrics.rewound.jsonl"):  # The last of each step: after the rollback.
    r = json.loads(line)
    if r["split"] == "train":
      before[r["step"]] = r
  after = _train_lines(a)
  for step in range(11, 15):
    for key in ("loss", "grad_norm", "param_norm", "telemetry/attn_logit_max/L0"):
      assert after[step][key] == before[step][key], (step, key)


def test_a_checkpoint_saved_before_the_loss_history_existed_restores(tmp_path):
  """Runs saved before TrainState.recent_loss resume with an empty history."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from flax import serialization  # pylint: disable=g-import-not-at-top
  from experiments.configs.base import train_defaults  # pylint: disable=g-import-not-at-top
  from model import ModelConfig  # pylint: disable=g-import-not-at-top
  from train import checkpoint as ckpt  # pylint: disable=g-import-not-at-top
  from train.optim import make_optimizer  # pylint: disable=g-import-not-at-top
  from train.state import init_state  # pylint: disable=g-import-not-at-top
  cfg = ModelConfig(vocab_size=32, d_model=16, num_layers=1, num_heads=2, num_kv_heads=2,
                    mlp_dim=32, max_seq_len=8)
  t = train_defaults()
  state = nn.unbox(init_state(cfg, make_optimizer(t, cfg), 0, 8))
  old = serialization.to_state_dict(state)
  del old["recent_loss"]
  manager = ckpt.make_manager(str(tmp_path), t)
  manager.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave(old),
                                          data=ocp.args.JsonSave({})))
  ckpt.seal(manager)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  got, _ = ckpt.restore_step(manager, 3, state, jax.tree.map(lambda _: device, state))
  manager.close()
  assert np.isnan(np.asarray(got.recent_loss)).all()
  np.testing.assert_array_equal(got.params["embedder"]["embedding"],
                                state.params["embedder"]["embedding"])

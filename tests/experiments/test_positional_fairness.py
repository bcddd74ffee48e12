"""Each point of the positional ablation trains its own method: a learned position
table must carry information, not sit at ~3% of the input and train like NoPE
(which it did when its init was 0.02 under a unit-variance token table: the two
matched to three decimals at every logged step)."""

from tests.cli import launch
from train.metrics import read_metrics

FLAGS = ("--config.train.steps=20", "--config.train.log_every=10",
         "--config.train.eval_every=20", "--config.train.checkpoint_every=20",
         "--config.train.async_checkpoint=False", "--config.train.tensorboard=False")


def final_loss(workdir) -> float:
  return [r for r in read_metrics(workdir) if r["split"] == "train"][-1]["loss"]


def test_learned_positions_train_differently_from_nope(tmp_path):
  losses = {}
  for encoding in ("learned", "none"):
    launch("--workdir", str(tmp_path / encoding), f"--config.model.pos_encoding={encoding}",
           *FLAGS)
    losses[encoding] = final_loss(tmp_path / encoding)
  # Measured: 5.52 vs 5.29 at step 20 (4.80 vs 4.45 at the end of a 30-step run; the same
  # to 3 decimals at every logged step before the fix).
  assert abs(losses["learned"] - losses["none"]) > 0.05, losses

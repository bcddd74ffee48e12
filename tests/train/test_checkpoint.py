"""Checkpoint retention: the last `keep_checkpoints`, plus every `keep_every`-th step."""

import dataclasses
import datetime
import os
import types

from orbax.checkpoint import checkpoint_managers

from tests.train.test_loop import smoke
from train import checkpoint, loop
from train.spec import TrainSpec


def _kept(policy, steps):
  now = datetime.datetime.now()
  infos = [types.SimpleNamespace(step=s, time=now, metrics=None) for s in steps]  # A Protocol.
  keep = policy.should_preserve(infos, context=checkpoint_managers.PreservationContext())
  return [s for s, k in zip(steps, keep) if k]


def test_preservation_policy_keeps_latest_and_periodic():
  t = TrainSpec(keep_checkpoints=2, keep_every=4)
  assert _kept(checkpoint.preservation_policy(t), list(range(1, 11))) == [4, 8, 9, 10]
  t = dataclasses.replace(t, keep_every=0)
  assert _kept(checkpoint.preservation_policy(t), list(range(1, 11))) == [9, 10]
  t = dataclasses.replace(t, keep_checkpoints=0)  # Never zero: something to resume from.
  assert _kept(checkpoint.preservation_policy(t), list(range(1, 11))) == [10]


def test_short_run_keeps_exactly_the_expected_steps(tmp_path):
  loop.run(smoke(**{"train.steps": 10, "train.checkpoint_every": 1, "train.eval_every": 10,
                    "train.keep_checkpoints": 2, "train.keep_every": 4}), str(tmp_path))
  steps = sorted(int(d) for d in os.listdir(checkpoint.checkpoint_dir(str(tmp_path)))
                 if d.isdigit())
  assert steps == [4, 8, 9, 10]
  manager = checkpoint.make_manager(str(tmp_path), read_only=True)
  assert list(manager.all_steps()) == [4, 8, 9, 10] and manager.latest_step() == 10

"""TensorBoard gets the config as text, MoE loads and router biases as histograms and a
sweep's hparams."""

import glob
import json
import logging
import os
import struct

from tensorboardX.proto import event_pb2

from experiments.configs import base
from train.metrics import MetricsWriter


def _events(directory):
  """Every Event in the TFRecord files under `directory` (recursively): tag -> kind."""
  tags = {}
  for path in glob.glob(os.path.join(directory, "**", "events.out.tfevents.*"), recursive=True):
    with open(path, "rb") as f:
      data = f.read()
    at = 0
    while at < len(data):
      (length,) = struct.unpack("<Q", data[at:at + 8])
      event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
      at += 12 + length + 4  # length, its crc, the record, its crc.
      for v in event.summary.value:
        kind = v.metadata.plugin_data.plugin_name or v.WhichOneof("value")
        tags.setdefault(v.tag, set()).add(kind)
  return tags


def test_config_text_histograms_and_final_hparams(tmp_path):
  c = base.get_config("smoke")
  with open(tmp_path / "config.json", "w") as f:
    json.dump({**c.to_dict(), "_run": {"git_commit": "x"}}, f)
  writer = MetricsWriter(str(tmp_path), enabled=True, tensorboard=True)
  writer.write({"step": 5, "split": "train", "loss": 3.0, "moe_load/layer0": [10, 2, 0, 4],
                "moe_bias/layer1": [0.01, -0.01, 0.0, 0.02]})
  writer.write({"step": 5, "split": "eval", "loss": 3.1})  # Not the final eval: no hparams.
  writer.write({"step": c.train.steps, "split": "eval", "loss": 2.5, "bpb": 3.0})
  writer.close()
  tags = _events(str(tmp_path / "tensorboard"))
  assert "text" in tags["config/text_summary"]
  assert tags["train/moe_load/layer0"] == {"histo"} and "train/loss" in tags
  assert tags["train/moe_bias/layer1"] == {"histo"}
  assert "hparams" in tags["_hparams_/session_start_info"]
  assert {"final/loss", "final/bpb"} <= set(tags)  # The HParams tab's metrics.
  hparam_dirs = glob.glob(str(tmp_path / "tensorboard" / "hparams"))
  assert len(hparam_dirs) == 1  # One session per run: a sweep root compares them.


def test_final_figures_at_other_lengths_are_named_without_tensorboardx_renaming(tmp_path,
                                                                              caplog):
  """Issue 46 item 7: `final/loss@256` (the HParams tab's metric) is spelt TensorBoard's way
  by the writer, so tensorboardX logs no "Summary name ... is illegal" line."""
  c = base.get_config("smoke")
  with open(tmp_path / "config.json", "w") as f:
    json.dump(c.to_dict(), f)
  writer = MetricsWriter(str(tmp_path), enabled=True, tensorboard=True)
  with caplog.at_level(logging.INFO):
    writer.write({"step": c.train.steps, "split": "eval", "loss": 2.5, "loss@256": 2.9,
                  "passkey/exact@256/depth50": 0.0})
    writer.close()
  assert "is illegal" not in caplog.text
  tags = _events(str(tmp_path / "tensorboard"))
  assert {"final/loss_256", "eval/loss_256", "eval/passkey/exact_256/depth50"} <= set(tags)

"""The run spec (train/spec/): read once, checked once, never mutating its input."""

import dataclasses

import pytest

from experiments.configs import base, tiny
from tests.cli import launch
from train import spec as spec_lib
from train.spec import checks


def test_parse_never_mutates_its_input_and_resolves_what_is_derived():
  c = tiny.get_config("smoke")
  before = c.to_dict()
  assert before["model"]["vocab_size"] is None  # The tokenizer's, resolved by the parser.
  spec = spec_lib.parse(c, 8)
  assert c.to_dict() == before
  assert spec.model.vocab_size == 256 and spec.record["model"]["vocab_size"] == 256
  assert spec.train.lr == c.train.lr and spec.data.seq_len == c.data.seq_len
  with pytest.raises(dataclasses.FrozenInstanceError):
    spec.train.lr = 1.0  # type: ignore[misc]


def test_the_base_config_is_built_from_the_spec_defaults():
  c = base.get_config()
  for section in spec_lib.sections.SECTIONS:
    assert c[section].to_dict() == spec_lib.defaults(section), section


def test_an_older_record_reads_with_what_its_absent_fields_meant_then():
  record = tiny.get_config("smoke").to_dict()
  for field in ("telemetry", "spike_threshold", "spike_window", "z_loss", "keep_steps"):
    del record["train"][field]
  del record["eval"]["tasks"], record["data"]["mixture"]
  spec = spec_lib.read(record)
  assert spec.train.telemetry is False and spec.train.spike_threshold == 0.0
  assert spec.train.z_loss == 0.0 and spec.train.keep_steps == ()
  assert spec.eval.tasks == "" and spec.data.mixture == ""


def test_each_error_names_the_field_as_before():
  c = tiny.get_config("smoke")
  c.train.lr = -1.0
  with pytest.raises(ValueError, match=r"config.train.lr=-1.0: must be a finite number"):
    spec_lib.parse(c, 8)


def test_validation_runs_once_per_run_through_launch(tmp_path, monkeypatch):
  """One parse per process per run: training, then --mode eval of the same run."""
  calls = []
  real = checks.check_sections
  monkeypatch.setattr(checks, "check_sections", lambda c: (calls.append(1), real(c))[1])
  fast = ("--config.train.steps=2", "--config.train.eval_every=2",
          "--config.train.checkpoint_every=2", "--config.train.async_checkpoint=False",
          "--config.train.tensorboard=False")
  launch("--workdir", str(tmp_path), *fast)
  assert len(calls) == 1
  launch("--mode", "eval", "--workdir", str(tmp_path))
  assert len(calls) == 2


def test_weights_that_fsdp_x_expert_cannot_split_are_refused_by_name():
  """parallel/rules.py splits d_model (outside the routed experts) and MLA's latents over
  fsdp x expert: sizes it does not divide are refused before anything compiles."""
  c = tiny.get_config("smoke")
  c.model.update(num_experts=4, d_model=36, num_heads=2, num_kv_heads=2)
  c.mesh.update(data=1, fsdp=2, expert=4)  # 36 divides by fsdp 2, not by 2 x 4.
  with pytest.raises(ValueError, match=r"model.d_model.*fsdp x expert = 8"):
    spec_lib.parse(c, 8)
  c.model.update(d_model=32, num_heads=4, num_kv_heads=4, attention_type="mla",
                 q_lora_rank=12, kv_lora_rank=16)
  with pytest.raises(ValueError, match=r"model.q_lora_rank.*=12 must be divisible by the "
                                       r"mesh's fsdp x expert = 8"):
    spec_lib.parse(c, 8)
  c.model.q_lora_rank = 16
  assert spec_lib.parse(c, 8).model.q_lora_rank == 16

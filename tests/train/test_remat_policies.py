"""Every named remat policy (model/remat.py) trains through launch.py with the losses of
remat=none: recomputation and saving change memory and time, never the numbers (float32,
within rtol 1e-6; on this CPU they came out bit-identical). An offloading policy keeps its
tensors on device on CPU and says so in the log. A bad custom map is refused naming the
field. make test runs two policies on the dense model; the slow tier every policy on it,
and a few on an MLA and an MoE variant."""

import functools

import pytest

from model import remat
from tests.cli import launch
from tests.losses import loss_mismatches, run_losses

RUN = ("--config.train.async_checkpoint=False", "--config.train.tensorboard=False",
       "--config.train.log_every=1", "--config.train.eval_every=2", "--config.train.steps=2")
VARIANTS = {
    "gqa": (),
    "mla": ("--config.model.attention_type=mla", "--config.model.q_lora_rank=16",
            "--config.model.kv_lora_rank=16", "--config.model.num_kv_heads=4"),
    "moe": ("--config.model.num_experts=4", "--config.model.experts_per_token=2"),
}
CUSTOM = "decoder_layer_input=offload,query_proj=device,key_proj=offload,context=device,mlpwo=remat"
# The policies beside none: all of them, and the custom map above.
POLICIES = [p for p in remat.NAMES if p != "none"]


def _train(tmp, variant: str, policy: str) -> list[tuple]:
  d = tmp / f"{variant}-{policy}"
  extra = (f"--config.model.remat_custom={CUSTOM}",) if policy == "custom" else ()
  launch("--workdir", str(d), *RUN, *VARIANTS[variant], f"--config.model.remat={policy}",
         *extra)
  return run_losses(d)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
  """remat=none's losses per variant, trained once per module."""
  tmp = tmp_path_factory.mktemp("remat")
  return functools.cache(lambda variant: _train(tmp, variant, "none")), tmp


def _mismatches(baseline, variant: str, policy: str) -> list[str]:
  base, tmp = baseline
  return loss_mismatches(base(variant), _train(tmp, variant, policy), rtol=1e-6)


@pytest.mark.parametrize("policy", ["full", "minimal_offloaded"])
def test_a_policy_trains_with_the_losses_of_no_remat(baseline, policy, caplog):
  remat._say_offload_degrades.cache_clear()  # pylint: disable=protected-access
  assert not _mismatches(baseline, "gqa", policy)
  said = [r for r in caplog.records if "so they stay on device" in r.getMessage()]
  assert len(said) == (policy == "minimal_offloaded"), said  # Once: train and eval traced.


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_trains_with_the_losses_of_no_remat(baseline, policy):
  assert not _mismatches(baseline, "gqa", policy)


@pytest.mark.parametrize("variant,policy", [
    ("mla", "minimal_with_context"), ("mla", "qkv_proj_offloaded"), ("mla", "custom"),
    ("moe", "minimal"), ("moe", "minimal_offloaded"), ("moe", "save_dot_except_mlp")])
def test_mla_and_moe_train_with_the_losses_of_no_remat(baseline, variant, policy):
  assert not _mismatches(baseline, variant, policy)


@pytest.mark.parametrize("flags,says", [
    (("--config.model.remat=custom", "--config.model.remat_custom=query_prj=offload"),
     "unknown tensor 'query_prj'"),
    (("--config.model.remat=custom", "--config.model.remat_custom=query_proj=host"),
     "query_proj='host': must be one of ('remat', 'device', 'offload')"),
    (("--config.model.remat=custom",), "remat='custom' needs the map"),
    (("--config.model.remat=full", "--config.model.remat_custom=context=device"),
     "is read only with remat='custom'"),
    (("--config.model.remat=minimal_offload",), "ModelConfig.remat='minimal_offload'"),
])
def test_a_bad_policy_is_refused_naming_the_field(tmp_path, flags, says):
  with pytest.raises(ValueError) as e:
    launch("--workdir", str(tmp_path / "r"), *RUN, *flags)
  assert says in str(e.value)
  assert "ModelConfig.remat" in str(e.value)
  assert not (tmp_path / "r").exists()

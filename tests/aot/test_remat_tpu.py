"""Remat policies and the vocabulary-tiled loss compiled for TPU v5e:2x2 (libtpu; the aot tier).

Properties: every named policy compiles for TPU on a small 1b-shaped model
(benchmarks/remat_memory.py's), and the compiled per-chip device memory (arguments +
temporaries) orders as the policies claim: nothing saved (full) is the least; a policy
saving a superset of another's tensors needs at least as much; no remat (none) the most; an
offloading policy holds less on the chip than its device twin and puts the rest in host
memory. The tiled loss's temporaries at a 128K vocabulary are a fraction of one chunk's.
"""

import pytest

from benchmarks import loss_memory, remat_memory
from model import ModelConfig, remat
from train.aot import libtpu_available

pytestmark = [pytest.mark.aot, pytest.mark.skipif(
    not libtpu_available(), reason="libtpu is not installed: make test-aot")]
TOPOLOGY, CHIPS = "v5e:2x2", 4
# minimal <= minimal_with_context is not asserted: measured, minimal needs 0.4% more (not
# investigated; docs/model.md, "Remat policies").
# Measured with the projections' bfloat16 input gradients (model/layers.py lowp_einsum):
# full holds 1% more than save_out_proj on this model (71.92 against 71.18 MB per chip;
# without them, 71.31 against 71.87). Compiled memory is the scheduler's, not a sum of
# saved tensors: where two policies are this close it can invert.
FULL_MISS = ("measured: full holds 1% more on the chip than save_out_proj on this model "
             "(71.92 against 71.18 MB; docs/model.md, 'Remat policies')")
# (smaller, larger): the first saves a subset of the second's tensors (model/remat.py NAMED).
SUBSETS = [pytest.param("full", "save_out_proj",
                        marks=pytest.mark.xfail(reason=FULL_MISS, strict=True)),
           ("full", "save_qkv_proj"), ("save_out_proj", "save_dot_except_mlp"),
           ("save_qkv_proj", "save_dot_except_mlp"), ("save_dot_except_mlp", "minimal")]
OFFLOADED = [("qkv_proj_offloaded", "save_qkv_proj"), ("minimal_offloaded", "minimal")]


@pytest.fixture(scope="module")
def measured():
  rows = {}
  for policy in (p for p in remat.NAMES if p != "custom"):
    config = remat_memory.small_config(policy, per_chip=4, seq_len=1024, layers=4,
                                       chips=CHIPS)
    rows[policy] = remat_memory.measure(config, TOPOLOGY)
  return rows


def test_every_policy_compiles_and_none_needs_the_most(measured):
  args = {r["arguments"] for r in measured.values()}
  assert len(args) == 1  # The same state: only what the backward pass keeps differs.
  for policy, r in measured.items():
    assert r["device"] <= measured["none"]["device"], (policy, r)
    if policy != "save_out_proj":  # FULL_MISS.
      assert measured["full"]["device"] <= r["device"], (policy, r)


@pytest.mark.parametrize("smaller,larger", SUBSETS)
def test_saving_more_tensors_never_needs_less_device_memory(measured, smaller, larger):
  assert measured[smaller]["device"] <= measured[larger]["device"], measured


@pytest.mark.parametrize("offloaded,twin", OFFLOADED)
def test_an_offloaded_policy_holds_less_on_the_chip_and_the_rest_on_the_host(
    measured, offloaded, twin):
  assert measured[offloaded]["device"] < measured[twin]["device"], measured


@pytest.mark.parametrize("offloaded", ["qkv_proj_offloaded", "minimal_offloaded"])
def test_an_offloaded_policy_puts_its_tensors_in_host_memory(measured, offloaded):
  # At least the stacked q, k, v of 4 layers at 4 x 1024 tokens per chip, bfloat16.
  assert measured[offloaded]["host"] >= 4 * 4 * 1024 * (4 + 2 + 2) * 64 * 2, measured
  assert all(r["host"] == 0 for p, r in measured.items() if not p.endswith("offloaded"))


def test_a_custom_map_offloads_what_it_names():
  config = remat_memory.small_config("custom", per_chip=4, seq_len=1024, layers=4, chips=CHIPS,
                                     custom="query_proj=offload,key_proj=offload,"
                                            "value_proj=offload")
  r = remat_memory.measure(config, TOPOLOGY)
  assert r["host"] > 0


def test_the_tiled_loss_compiles_with_a_fraction_of_one_chunks_temporaries():
  """At vocab 128,256 (Llama 3's) on a small model: 8 chunks against loss_chunks=1."""
  from train.aot.topology import parse_topology, topology_devices  # pylint: disable=g-import-not-at-top
  devices = topology_devices(parse_topology(TOPOLOGY))
  cfg = ModelConfig(vocab_size=128256, d_model=256, num_layers=1, num_heads=4, num_kv_heads=4,
                    mlp_dim=512, max_seq_len=1024, dtype="bfloat16", loss_chunks=1)
  one = loss_memory.compile_loss(cfg, devices, 2 * CHIPS, tiled=True)
  eight = loss_memory.compile_loss(cfg.replace(loss_chunks=8), devices, 2 * CHIPS, tiled=True)
  assert not one.get("out_of_memory") and not eight.get("out_of_memory")
  # One chunk holds a chip's [2, 1024, 128256] float32 logits (1 GiB) and their gradient;
  # eight chunks an eighth of them at a time.
  assert eight["temporaries"] * 4 <= one["temporaries"], (one, eight)

"""Topology names and the errors of bad input (no libtpu needed: nothing compiles)."""

import pytest

from experiments.configs import pod
from train.aot import parse_topology
from train.aot.compile import validate_for


@pytest.mark.parametrize("name, libtpu_name, chips", [
    ("v5e:2x2", "v5e:2x2", 4), ("v5e-16", "v5e:4x4", 16), ("v5p-64", "v5p:2x4x4", 32),
    ("v5p-128", "v5p:4x4x4", 64), ("v6e-256", "v6e:16x16", 256),
    ("v5p-1024", "v5p:8x8x8", 512), ("v5p:4x4x4", "v5p:4x4x4", 64)])
def test_product_and_libtpu_names(name, libtpu_name, chips):
  topo = parse_topology(name)
  assert (topo.name, topo.num_chips) == (libtpu_name, chips)
  assert parse_topology(name, num_slices=2).num_chips == 2 * chips


@pytest.mark.parametrize("name, says", [
    ("v9x:2x2", "unknown TPU generation 'v9x'"), ("v5p:4x4", "3 axes"),
    ("tpu-16", "not a topology name"), ("v5p-63", "TensorCores")])
def test_unknown_topology_lists_the_known_ones(name, says):
  with pytest.raises(ValueError) as e:
    parse_topology(name)
  assert says in str(e.value)
  assert "v5e" in str(e.value) and "v6e" in str(e.value) and "v5p:4x4x4" in str(e.value)


def test_mesh_that_does_not_match_the_topology_names_both():
  config = pod.get_config("preset=1b")
  config.mesh.update(data=1, fsdp=8, tensor=2)
  with pytest.raises(ValueError) as e:
    validate_for(config, parse_topology("v5p:4x4x4"))
  msg = str(e.value)
  assert "multiply to 16" in msg and "64 devices" in msg and "v5p:4x4x4" in msg, msg

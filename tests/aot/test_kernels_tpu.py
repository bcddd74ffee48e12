"""The kernels that only a TPU runs, compiled for one (v5e:2x2) with libtpu: every option
Splash serves, forward and backward, shard_mapped over a (data, tensor) mesh; and the
ragged all-to-all of dropless expert parallelism inside a real train step."""

import jax
import jax.numpy as jnp
import pytest

from experiments.configs import pod
from model.attention.impls import IMPLS
from model.attention.reference import AttnData, AttnSpec
from model.backend import target_backend
from parallel import logical_rules, make_mesh, mesh_context
from train.aot import compile_for_topology, libtpu_available, parse_topology
from train.aot.topology import topology_devices

pytestmark = [pytest.mark.aot, pytest.mark.skipif(
    not libtpu_available(), reason="libtpu is not installed: make test-aot")]
N, H = 4, 128
# (KV heads, length, sliding window, soft-cap): GQA causal, MQA local, GQA soft-capped,
# MHA local + soft-cap at a length Splash pads (200 -> 256).
VARIANTS = ((2, 256, 0, 0.0), (1, 256, 128, 0.0), (2, 256, 0, 30.0), (4, 200, 64, 50.0))


def _loss(qkv, segment_ids):
  total = 0.0
  for (K, L, window, softcap), (q, k, v), seg in zip(VARIANTS, qkv, segment_ids):
    pos = jnp.broadcast_to(jnp.arange(L), seg.shape)
    out = IMPLS["splash"](q, k, v, AttnData(seg, seg, pos, pos),
                          AttnSpec(scale=H ** -0.5, softcap=softcap, sliding_window=window))
    total = total + jnp.sum(out.astype(jnp.float32))
  return total


def test_splash_compiles_for_tpu_with_every_option():
  devices = topology_devices(parse_topology("v5e:2x2"))
  mesh = make_mesh({"data": 2, "tensor": 2}, devices)
  rules = logical_rules(mesh=mesh, num_kv_heads=2, num_heads=N)
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  qkv, segment_ids = [], []
  for K, L, _, _ in VARIANTS:
    qkv.append(tuple(jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=rows)
                     for s in ((4, L, K, N // K, H), (4, L, K, H), (4, L, K, H))))
    segment_ids.append(jax.ShapeDtypeStruct((4, L), jnp.int32, sharding=rows))
  with target_backend("tpu"), mesh_context(mesh, rules):
    compiled = jax.jit(jax.grad(_loss)).lower(qkv, segment_ids).compile()
  kernels = compiled.as_text().count('custom_call_target="tpu_custom_call"')
  assert kernels >= 3 * len(VARIANTS), kernels  # Forward, dq and dkv for each variant.


def test_ragged_all_to_all_compiles_in_the_train_step():
  config = pod.get_config("preset=moe,smoke")
  config.mesh.update(data=1, expert=4)
  assert config.model.moe_dispatch == "expert_parallel_ragged"
  r = compile_for_topology(config, "v5e:2x2", steps=("train",), roofline=False)
  assert r["fits"]
  c = r["steps"]["train"]["collectives"]
  # Dispatch and return, forward and backward, per MoE layer.
  exchanges = c["ragged-all-to-all"]["count"] + c["all-to-all"]["count"]
  assert exchanges >= 4 * config.model.num_layers, c

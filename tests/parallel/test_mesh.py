"""Mesh sizes, -1 filling, clear errors, launcher detection and a real 2-process run."""

import json
import textwrap

import jax
import pytest

from parallel import mesh as mesh_lib
from tests.parallel import two_processes

AUTO = jax.sharding.AxisType.Auto


def test_default_config_puts_all_devices_on_data():
  mesh = mesh_lib.make_mesh({"data": -1, "fsdp": 1, "tensor": 1, "expert": 1})
  assert mesh.axis_names == ("stage", "data", "fsdp", "context", "tensor", "expert")
  assert dict(mesh.shape) == {"stage": 1, "data": 8, "fsdp": 1, "context": 1, "tensor": 1,
                              "expert": 1}
  assert mesh.axis_types == (AUTO,) * 6  # Not JAX 0.10's Explicit default.
  assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())


@pytest.mark.parametrize("cfg, shape", [
    ({"data": -1, "fsdp": 2, "tensor": 2}, (1, 2, 2, 1, 2, 1)),
    ({"fsdp": -1, "expert": 2}, (1, 1, 4, 1, 1, 2)),
    ({"data": 2, "fsdp": 1, "tensor": 4, "expert": 1}, (1, 2, 1, 1, 4, 1)),  # No -1: exact.
    ({"tensor": -1}, (1, 1, 1, 1, 8, 1)),  # Missing keys count as 1.
    ({"data": 2, "context": -1}, (1, 2, 1, 4, 1, 1)),
    ({"stage": 2, "fsdp": -1}, (2, 1, 4, 1, 1, 1)),
])
def test_sizes_and_fill(cfg, shape):
  mesh = mesh_lib.make_mesh(cfg)
  assert tuple(mesh.shape.values()) == shape
  assert mesh_lib.mesh_shape(cfg, 8) == dict(zip(mesh_lib.AXES, shape))


def test_subset_of_devices():
  mesh = mesh_lib.make_mesh({"data": -1, "tensor": 2}, devices=jax.devices()[:4])
  assert dict(mesh.shape) == {"stage": 1, "data": 2, "fsdp": 1, "context": 1, "tensor": 2,
                              "expert": 1}


@pytest.mark.parametrize("cfg, words", [
    ({"data": 3}, ["data=3", "multiply to 3", "8 devices"]),
    ({"data": 2, "tensor": 2}, ["data=2", "tensor=2", "multiply to 4", "8 devices"]),
    ({"data": -1, "fsdp": 3}, ["fsdp=3", "data=-1", "8 devices"]),
    ({"data": -1, "fsdp": -1}, ["only one axis may be -1", "data", "fsdp"]),
    ({"tensor": 0, "data": -1}, ["mesh.tensor=0"]),
    ({"fsdp": 2.0, "data": -1}, ["mesh.fsdp=2.0", "int"]),
    ({"dcn_data": -1}, ["mesh.dcn_data=-1", "positive"]),
    ({"dcn_data": 3}, ["dcn", "multiply to 3", "8 devices"]),
    ({"data": -1, "dcn_data": 2}, ["dcn", "multiply to 2", "span 1 processes"]),
    ({"tensro": 2}, ["unknown keys", "tensro"]),
])
def test_bad_config_names_the_problem(cfg, words):
  with pytest.raises(ValueError) as err:
    mesh_lib.make_mesh(cfg)
  for word in words:
    assert word in str(err.value), (word, str(err.value))


@pytest.mark.parametrize("env, launcher", [
    ({}, None),
    ({"SLURM_NTASKS": "4", "SLURM_PROCID": "1"}, "slurm"),
    ({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, None),  # One task: nothing to join.
    ({"SLURM_NTASKS": "4"}, None),  # Allocation without a task id (e.g. salloc shell).
    ({"TPU_WORKER_HOSTNAMES": "h0,h1"}, "tpu"),
    ({"TPU_WORKER_HOSTNAMES": "h0"}, None),  # Single-host TPU VM.
    ({"MEGASCALE_COORDINATOR_ADDRESS": "h0:8080"}, "tpu"),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, "openmpi"),
])
def test_detect_launcher(env, launcher):
  assert mesh_lib.detect_launcher(env) == launcher


def test_single_process_does_not_initialize(monkeypatch):
  for key in ("SLURM_NTASKS", "TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES",
              "MEGASCALE_COORDINATOR_ADDRESS", "OMPI_COMM_WORLD_SIZE"):
    monkeypatch.delenv(key, raising=False)
  assert mesh_lib.maybe_initialize_distributed() is False
  assert mesh_lib.maybe_initialize_distributed(num_processes=1) is False
  assert not jax.distributed.is_initialized()


_WORKER = textwrap.dedent("""
    import json, sys
    import numpy as np
    from parallel import mesh as mesh_lib  # Before any JAX device call.
    assert mesh_lib.maybe_initialize_distributed(sys.argv[1], 2, int(sys.argv[2]))
    import jax, jax.numpy as jnp
    from parallel import rules as rules_lib, sharding
    results = []
    for cfg in ({"data": -1}, {"data": -1, "tensor": 2, "dcn_data": 2}):
      mesh = mesh_lib.make_mesh(cfg)
      rules = rules_lib.logical_rules(mesh=mesh)
      spec = sharding.batch_sharding(mesh, rules)
      rows = sharding.host_batch_slice(spec, 8)
      global_np = np.arange(8 * 3, dtype=np.int32).reshape(8, 3)
      batch = sharding.host_local_to_global({"x": global_np[rows]}, mesh, spec)["x"]
      assert batch.shape == (8, 3), batch.shape
      row_sums = jax.jit(lambda x: x.sum(1), out_shardings=jax.NamedSharding(
          mesh, jax.P()))(batch)  # Replicated: every process can read it all.
      results.append({"shape": dict(mesh.shape), "rows": [rows.start, rows.stop],
                      "sums": np.asarray(row_sums).tolist()})
    jax.distributed.shutdown()
    with open(sys.argv[3], "w") as f:  # A file: gloo's logging shares stdout.
      json.dump(results, f)
""")


def test_two_processes_build_a_global_batch(tmp_path):
  """Two CPU processes of 4 devices: the distributed start-up, the hybrid (DCN)
  mesh and host-local rows -> one global batch, checked against the full array."""
  script = tmp_path / "worker.py"
  script.write_text(_WORKER)
  results = [tmp_path / f"results{i}.json" for i in range(2)]
  two_processes.run(lambda i, port: [str(script), f"localhost:{port}", str(i), str(results[i])],
                    tmp_path)
  want = [sum(range(3 * r, 3 * r + 3)) for r in range(8)]
  for i, path in enumerate(results):
    plain, hybrid = json.loads(path.read_text())
    assert plain["shape"] == {"stage": 1, "data": 8, "fsdp": 1, "context": 1, "tensor": 1,
                              "expert": 1}
    assert hybrid["shape"] == {"stage": 1, "data": 4, "fsdp": 1, "context": 1, "tensor": 2,
                               "expert": 1}
    for got in (plain, hybrid):
      assert got["rows"] == [4 * i, 4 * i + 4]  # Process i holds rows 4i..4i+3.
      assert got["sums"] == want

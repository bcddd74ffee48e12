"""blockwork.parallel: devices, meshes and shardings. Never imports model/ or train/.

  mesh      make_mesh(mesh_cfg) over axes ("stage", "data", "fsdp", "context", "tensor", "expert"),
            maybe_initialize_distributed() for multi-host runs
  rules     logical_rules(...): THE logical name -> mesh axes table; PRESETS
  sharding  sharded_init (the one init path), abstract_shardings,
            logical_to_mesh_sharding, batch_sharding,
            host_batch_slice, host_local_to_global, mesh_context
  expert    expert-parallel all_to_all / ragged exchange under shard_map
  context   context parallelism: the ring (ppermute) and zig-zag layout under shard_map
  pipeline  pipeline parallelism over "stage": the GPipe schedule (shard_map + ppermute)
"""

from parallel.mesh import AXES, make_mesh, maybe_initialize_distributed, mesh_shape
from parallel.rules import LOGICAL_NAMES, PRESETS, Rules, logical_rules
from parallel.sharding import (abstract_shardings, batch_sharding, host_batch_slice,
                               host_local_to_global, logical_to_mesh_sharding, mesh_context,
                               sharded_init)

__all__ = [
    "AXES", "LOGICAL_NAMES", "PRESETS", "Rules", "abstract_shardings", "batch_sharding", "host_batch_slice",
    "host_local_to_global", "logical_rules", "logical_to_mesh_sharding", "make_mesh",
    "maybe_initialize_distributed", "mesh_context", "mesh_shape", "sharded_init",
]

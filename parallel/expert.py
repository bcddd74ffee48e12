"""Expert parallelism: experts split over the mesh's "expert" axis, tokens moved by all_to_all.

Generic over the expert computation (this file never imports model/): model/dispatch.py
hands in a per-shard function. The pattern is GShard's: every device routes its own
rows of the batch into fixed-capacity buffers x_EBCD, one all_to_all sends buffer
slice e to the device that holds expert e, the local experts run on every device's
tokens, and the reverse all_to_all brings the outputs home to be combined.

Only the "expert" axis is manual inside `jax.shard_map`; the other mesh axes stay
Auto, so data / fsdp / tensor sharding of the same arrays is still left to GSPMD.

The mesh comes from context: `jax.set_mesh(mesh)`, which parallel.mesh_context uses.
With no mesh at all (e.g. `init` on one device) the caller falls back to the
numerically identical single-device computation. JAX 0.10 hides the deprecated
`with mesh:` from `jax.sharding.get_abstract_mesh()`; that case is an error here
rather than a silent fallback.

A dropless, ragged variant (`jax.lax.ragged_all_to_all`) is not provided: XLA
implements that collective only on TPU and GPU, so it could not be tested here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

AXIS = "expert"
P = jax.sharding.PartitionSpec


def expert_axis_size(axis: str = AXIS) -> int:
  """Size of `axis` in the context mesh; 1 when no mesh is set (plain init / CPU tests).

  A mesh that lacks the axis is a configuration error, not something to paper over.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    if not _legacy_mesh_context().empty:
      raise ValueError("expert-parallel dispatch found a mesh set by the deprecated "
                       "`with mesh:`; use `with jax.set_mesh(mesh):` (parallel.mesh_context)")
    return 1
  if axis not in mesh.axis_names:
    raise ValueError(f"expert-parallel dispatch needs a mesh axis named {axis!r}; the "
                     f"mesh in context has axes {dict(mesh.shape)}. Build the mesh with "
                     f"parallel.make_mesh or use moe_dispatch='capacity' / 'dropless'")
  return int(mesh.shape[axis])


def _legacy_mesh_context() -> Any:
  """The mesh of a deprecated `with mesh:` block (private JAX state, read defensively)."""
  try:
    from jax._src import mesh as mesh_src  # pylint: disable=g-import-not-at-top
    return mesh_src.thread_resources.env.physical_mesh
  except (ImportError, AttributeError):
    return jax.sharding.get_abstract_mesh()  # empty


def shard_over_experts(fn: Callable[..., Any], batch_args: Sequence[Any],
                       expert_args: Sequence[Any], axis: str = AXIS) -> Any:
  """fn(*batch_shards, *expert_shards) with `axis` manual.

  Every leaf of `batch_args` is split along its leading (batch) dimension, every leaf of
  `expert_args` along its leading (expert) dimension; every output leaf is split along
  its leading (batch) dimension. Inside `fn`, `to_experts` / `from_experts` move data.
  """
  n = len(batch_args) + len(expert_args)
  return jax.shard_map(fn, in_specs=(P(axis),) * n, out_specs=P(axis),
                       axis_names={axis})(*batch_args, *expert_args)


def to_experts(x_EBCD: jax.Array, axis: str = AXIS) -> jax.Array:
  """Per-device buffers [E, B, C, D] -> [E / ep, ep * B, C, D]: this device's experts'
  slots from every device, grouped by source device (device-major along the batch)."""
  return jax.lax.all_to_all(x_EBCD, axis, split_axis=0, concat_axis=1, tiled=True)


def from_experts(y_EBCD: jax.Array, axis: str = AXIS) -> jax.Array:
  """The inverse of `to_experts`: [E / ep, ep * B, C, D] -> [E, B, C, D]."""
  return jax.lax.all_to_all(y_EBCD, axis, split_axis=1, concat_axis=0, tiled=True)

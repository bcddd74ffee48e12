"""Expert parallelism: experts split over the mesh's "expert" axis, tokens moved by all_to_all.

Generic over the expert computation (this file never imports model/): model/moe/dispatch.py
hands in a per-shard function. The pattern is GShard's: every device routes its own
rows of the batch into fixed-capacity buffers x_EBCD, one all_to_all sends buffer
slice e to the device that holds expert e, the local experts run on every device's
tokens, and the reverse all_to_all brings the outputs home to be combined.

Every axis that splits the batch (parallel/rules.py BATCH_AXES: data, fsdp, expert; stage,
which refuses expert-parallel dispatch) is
manual inside `jax.shard_map`, so the per-shard function holds exactly this device's rows
of the batch and sizes its buffers from them; the other axes (context, tensor) stay Auto,
left to GSPMD. (With only "expert" manual, a device's view of the batch was B / ep rows,
not B / (data * fsdp * ep): the ragged receive buffer of the moe preset on v5p-64 came
out data * fsdp = 4x too large, 165 GiB of temporaries per chip; docs/PERFORMANCE.md.)

The mesh comes from context: `jax.set_mesh(mesh)`, which parallel.mesh_context uses.
With no mesh at all (e.g. `init` on one device) the caller falls back to the
numerically identical single-device computation. JAX 0.10 hides the deprecated
`with mesh:` from `jax.sharding.get_abstract_mesh()`; that case is an error here
rather than a silent fallback.

The dropless variant (MaxText's "ragged all-to-all" design) moves exactly the routed
rows instead of fixed buffers: every device sorts its (token, expert) pairs by expert,
the per-expert counts are all-gathered, and `jax.lax.ragged_all_to_all` sends each
device the rows of its experts (`ragged_to_experts`); the outputs go back the same way
(`ragged_from_experts`). XLA implements that collective on TPU and GPU only (XLA:CPU
has no `ragged-all-to-all` in JAX 0.10), so `ragged_collective()` refuses CPU.

Shape suffixes follow model/__init__.py's legend; here O is a device of the expert
axis (ep of them) and X a local expert (E / ep per device).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp

from parallel import rules

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
                     f"parallel.make_mesh or use moe_dispatch='auto' / 'dropless'")
  return int(mesh.shape[axis])


def _legacy_mesh_context() -> Any:
  """The mesh of a deprecated `with mesh:` block (private JAX state, read defensively)."""
  try:
    from jax._src import mesh as mesh_src  # pylint: disable=g-import-not-at-top
    return mesh_src.thread_resources.env.physical_mesh
  except (ImportError, AttributeError):
    return jax.sharding.get_abstract_mesh()  # empty


def batch_axes(axis: str = AXIS) -> tuple[str, ...]:
  """The context mesh's axes that split the batch (BATCH_AXES, in that order), those of
  size > 1 and `axis` itself: the axes `shard_over_experts` makes manual."""
  mesh = jax.sharding.get_abstract_mesh()
  return tuple(a for a in rules.BATCH_AXES
               if a == axis or (a in mesh.axis_names and mesh.shape[a] > 1))


def batch_shards(axis: str = AXIS) -> int:
  """How many row shards the batch has under `shard_over_experts` (1 without a mesh)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return 1
  return math.prod(int(mesh.shape[a]) for a in batch_axes(axis))


def shard_over_experts(fn: Callable[..., Any], batch_args: Sequence[Any],
                       expert_args: Sequence[Any], axis: str = AXIS) -> Any:
  """fn(*batch_shards, *expert_shards) with every batch axis manual (`batch_axes`).

  Every leaf of `batch_args` is split along its leading (batch) dimension over all the
  batch axes, as the rules table splits the batch, so `fn` sees this device's own rows;
  every leaf of `expert_args` along its leading (expert) dimension over `axis` (whole
  over the other batch axes: an FSDP-sharded weight is gathered on entry, its gradient
  summed on the way out); every output leaf is split like `batch_args`. Inside `fn`,
  `to_experts` / `from_experts` (or the ragged pair) move data along `axis`.
  """
  if outer := sorted(jax.sharding.get_abstract_mesh().manual_axes):
    raise ValueError(
        f"expert-parallel dispatch cannot run inside a shard_map over {outer} (e.g. pipeline "
        "stages): its own shard_map (every batch axis manual) does not nest in JAX 0.10 "
        "(unchecked, the expert weights' cotangents lose the outer axis, 'Expected "
        "cotangent type ...{V:stage}'; checked, Shardy rejects the manual 'data' after the "
        "free 'stage'). Use moe_dispatch='auto' or 'capacity_einsum': GSPMD splits their "
        "expert einsums over mesh.expert inside each stage")
  rows = P(batch_axes(axis))
  specs = (rows,) * len(batch_args) + (P(axis),) * len(expert_args)
  # check_vma=False: megablox's group metadata (jnp.histogram -> searchsorted) fails
  # JAX 0.10's varying-axes check inside shard_map, as MaxText's check_rep=False avoids.
  return jax.shard_map(fn, in_specs=specs, out_specs=rows, axis_names=set(batch_axes(axis)),
                       check_vma=False)(*batch_args, *expert_args)


def _need_divisible(n: int, axis: str, what: str) -> None:
  ep = jax.lax.axis_size(axis)
  if n % ep:
    raise ValueError(f"{what} of size {n}: must be divisible by the {axis!r} axis size {ep}")


def to_experts(x_EBCD: jax.Array, axis: str = AXIS) -> jax.Array:
  """Per-device buffers [E, B, C, D] -> [E / ep, ep * B, C, D]: this device's experts'
  slots from every device, grouped by source device (device-major along the batch)."""
  chex.assert_rank(x_EBCD, 4)
  _need_divisible(x_EBCD.shape[0], axis, "experts (dim 0)")
  return jax.lax.all_to_all(x_EBCD, axis, split_axis=0, concat_axis=1, tiled=True)


def from_experts(y_EBCD: jax.Array, axis: str = AXIS) -> jax.Array:
  """The inverse of `to_experts`: [E / ep, ep * B, C, D] -> [E, B, C, D]."""
  chex.assert_rank(y_EBCD, 4)
  _need_divisible(y_EBCD.shape[1], axis, "batch (dim 1)")
  return jax.lax.all_to_all(y_EBCD, axis, split_axis=1, concat_axis=0, tiled=True)


# Dropless (ragged) exchange ------------------------------------------------------------
# The signature of jax.lax.ragged_all_to_all: (operand, output, input_offsets, send_sizes,
# output_offsets, recv_sizes, *, axis_name) -> output with the received rows written in.
RaggedCollective = Callable[..., jax.Array]


def ragged_collective(backend: str | None = None) -> RaggedCollective:
  """`jax.lax.ragged_all_to_all`, or a clear error on a backend that cannot run it.

  `backend`: the one the program is traced for (default: jax.default_backend(); a TPU
  compile on a CPU host, train/aot/, says "tpu")."""
  if (backend or jax.default_backend()) == "cpu":
    raise NotImplementedError(
        "moe_dispatch='expert_parallel_ragged' needs jax.lax.ragged_all_to_all, which "
        f"XLA:CPU does not implement (JAX {jax.__version__}: HLO `ragged-all-to-all` is "
        "not supported by XLA:CPU); run it on GPU or TPU, or use moe_dispatch="
        "'expert_parallel' (fixed capacity) or 'dropless' on CPU")
  return jax.lax.ragged_all_to_all


class RaggedRoute(NamedTuple):
  """Who sent how many rows to whom, so that outputs return the way inputs came."""

  sent_OO: jax.Array  # [O, O] int32: rows device s sends to device d (same on all).
  local_sizes_OX: jax.Array  # [O, X]: rows from device s for local expert x.


def _exclusive_cumsum(a: jax.Array, axis: int) -> jax.Array:
  return jnp.cumsum(a, axis=axis) - a


def _exchange(x: jax.Array, rows: int, sent_OO: jax.Array, axis: str,
              collective: RaggedCollective) -> jax.Array:
  """Sends row block d of `x` (sizes sent_OO[me], contiguous, in device order) to device d;
  returns [rows, ...] with the blocks received from devices 0, 1, ... packed in order."""
  me = jax.lax.axis_index(axis)
  send_O = sent_OO[me]
  # Where my block lands on device d: after what devices 0..me-1 send to d.
  output_offsets_O = _exclusive_cumsum(sent_OO, 0)[me]
  out = jnp.zeros((rows, *x.shape[1:]), x.dtype)
  return collective(x, out, _exclusive_cumsum(send_O, 0), send_O, output_offsets_O,
                    sent_OO[:, me], axis_name=axis)


def ragged_to_experts(x_sorted: jax.Array, group_sizes_E: jax.Array, rows: int,
                      axis: str = AXIS, collective: RaggedCollective | None = None
                      ) -> tuple[jax.Array, RaggedRoute]:
  """Rows sorted by global expert (counts group_sizes_E) -> the rows of this device's
  experts from every device: [rows, ...], grouped by source device, then by local expert
  (counts in route.local_sizes_OX), zero padding after. Inside `shard_over_experts`.

  `rows` is the receive buffer; dropless needs the worst case, every device's pairs for
  this device's experts.
  """
  chex.assert_rank(group_sizes_E, 1)
  chex.assert_axis_dimension_gteq(x_sorted, 0, 1)
  collective = collective or jax.lax.ragged_all_to_all
  ep, me = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
  E = group_sizes_E.shape[0]
  _need_divisible(E, axis, "group_sizes_E")
  sizes_OE = jax.lax.all_gather(group_sizes_E.astype(jnp.int32), axis)  # [ep, E]
  sizes_OOX = sizes_OE.reshape(ep, ep, E // ep)  # source, destination, local expert
  route = RaggedRoute(sent_OO=sizes_OOX.sum(-1), local_sizes_OX=sizes_OOX[:, me])
  return _exchange(x_sorted, rows, route.sent_OO, axis, collective), route


def ragged_from_experts(y_recv: jax.Array, route: RaggedRoute, rows: int, axis: str = AXIS,
                        collective: RaggedCollective | None = None) -> jax.Array:
  """The inverse of `ragged_to_experts`: [rows] of this device's pairs, sorted by expert."""
  ep = jax.lax.axis_size(axis)
  chex.assert_shape([route.sent_OO], (ep, ep))
  chex.assert_axis_dimension(route.local_sizes_OX, 0, ep)
  collective = collective or jax.lax.ragged_all_to_all
  return _exchange(y_recv, rows, route.sent_OO.T, axis, collective)

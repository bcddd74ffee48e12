"""Logical names -> shardings, sharded initialisation and global batches.

Generic over any Flax init function and pytree: nothing here knows the model.
The recipe (nanodo `_init_train_state`, flax lm1b): `jax.eval_shape` the init to get
boxed shapes with logical names, map the names to NamedShardings with the rules
table, then `jax.jit(init, out_shardings=...)` so every device computes only its
own shard and the full parameters never sit on one device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from parallel.rules import Rules

P = jax.sharding.PartitionSpec
NamedSharding = jax.sharding.NamedSharding


@contextlib.contextmanager
def mesh_context(mesh: jax.sharding.Mesh, rules: Rules) -> Iterator[None]:
  """Mesh and rules in scope, so linen's logical constraints take effect."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    yield


def _check_names(specs: Any, rules: Rules) -> None:
  """A misspelled logical name would silently replicate; make it an error."""
  known = {name for name, _ in rules}
  used = set()
  for spec in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)):
    for entry in spec:
      used.update([entry] if isinstance(entry, str) else entry or ())
  if unknown := sorted(used - known):
    raise ValueError(f"logical axis names {unknown} have no rule; known: {sorted(known)}")


def logical_to_mesh_sharding(tree: Any, mesh: jax.sharding.Mesh, rules: Rules) -> Any:
  """NamedShardings for a (possibly abstract) tree whose leaves carry logical names.

  Boxed leaves (`nn.LogicallyPartitioned`) become one NamedSharding each, in place
  of the box; plain array leaves are replicated. The result has the structure of
  `nn.unbox(tree)`.
  """
  specs = nn.get_partition_spec(tree)
  _check_names(specs, rules)
  return nn.logical_to_mesh_sharding(specs, mesh, rules)


def abstract_shardings(init_fn: Callable[..., Any], *args: Any, mesh: jax.sharding.Mesh,
                       rules: Rules) -> tuple[Any, Any]:
  """(unboxed abstract tree, its NamedShardings) of `init_fn(*args)`, computing nothing:
  a restore target, or the `shardings` of a later `sharded_init`."""
  abstract = jax.eval_shape(init_fn, *args)
  return nn.unbox(abstract), logical_to_mesh_sharding(abstract, mesh, rules)


def sharded_init(init_fn: Callable[..., Any], *args: Any, mesh: jax.sharding.Mesh | None,
                 rules: Rules | None, shardings: Any = None) -> tuple[Any, Any]:
  """Runs `init_fn(*args)` sharded; returns (unboxed variables, their shardings).

  The one initialisation path of the project (training, benchmarks, tests):
  `init_fn` may return any pytree with boxed leaves, e.g. `model.init` or a function
  that also builds the optimizer state: optax maps over the boxes, so the moments
  inherit the parameters' logical names and shardings. `shardings`: from
  `abstract_shardings`, when the caller has them already. `mesh=None`: one device.
  """
  def init_unboxed(*a):
    return nn.unbox(init_fn(*a))

  if mesh is None:
    return jax.jit(init_unboxed)(*args), None
  if shardings is None:
    _, shardings = abstract_shardings(init_fn, *args, mesh=mesh, rules=rules)
  with mesh_context(mesh, rules):
    variables = jax.jit(init_unboxed, out_shardings=shardings)(*args)
  return variables, shardings


def batch_sharding(mesh: jax.sharding.Mesh, rules: Rules) -> NamedSharding:
  """Sharding of a [B, L] batch: rows over every data-like axis, columns over "context"."""
  return NamedSharding(mesh, nn.logical_to_mesh_axes(("batch", "length"), rules))


def host_batch_slice(sharding: NamedSharding, global_batch: int) -> slice:
  """The rows of a global batch of `global_batch` rows that this process's devices hold.

  A data loader reads exactly these rows and hands them to `host_local_to_global`.
  Processes that differ only along non-batch mesh axes (e.g. tensor across hosts)
  get the same rows.
  """
  rows = _addressable_rows(sharding, global_batch)
  lo, hi = min(rows), max(rows) + 1
  if len(rows) != hi - lo:
    raise ValueError(f"this process's batch rows are not contiguous: {sorted(rows)}")
  return slice(lo, hi)


def _addressable_rows(sharding: NamedSharding, global_batch: int) -> set[int]:
  """The rows (dim 0) of a `global_batch`-row array that this process's devices hold."""
  # The other dimensions sized to split evenly (the length over "context", for one).
  mesh_shape = dict(sharding.mesh.shape)
  size = lambda axes: int(np.prod([mesh_shape[a] for a in
                                   ((axes,) if isinstance(axes, str) else axes or ())]))
  shape = (global_batch,) + tuple(size(axes) for axes in tuple(sharding.spec)[1:])
  rows = set()
  for index in sharding.addressable_devices_indices_map(shape).values():
    rows.update(range(*index[0].indices(global_batch)[:2]))
  return rows


def host_local_to_global(batch_np: Any, mesh: jax.sharding.Mesh,
                         sharding: NamedSharding) -> Any:
  """Global jax.Arrays (same pytree) from this process's rows of a numpy batch.

  Each process passes the rows `host_batch_slice` names, whole along every other
  dimension: the global shape is those rows' share of the batch, times the other
  dimensions as given, so a process whose devices hold part of the length (context
  parallelism across hosts) takes its slice of the rows it read. With one process
  this is a sharded `device_put`.
  """
  if sharding.mesh != mesh:
    raise ValueError(f"the sharding's mesh {dict(sharding.mesh.shape)} is not the given "
                     f"mesh {dict(mesh.shape)}")
  batch_np = jax.tree.map(np.asarray, batch_np)
  # Rows per shard of the batch dimension, then as many shards as the sharding has.
  shards = len(_addressable_rows(sharding, _batch_shards(sharding)))

  def global_shape(x):
    return (x.shape[0] * _batch_shards(sharding) // shards,) + x.shape[1:]

  return jax.make_array_from_process_local_data(sharding, batch_np,
                                                jax.tree.map(global_shape, batch_np))


def _batch_shards(sharding: NamedSharding) -> int:
  """How many ways the batch dimension is split."""
  axes = tuple(sharding.spec)[0] if len(sharding.spec) else None
  axes = (axes,) if isinstance(axes, str) else axes or ()
  return int(np.prod([dict(sharding.mesh.shape)[a] for a in axes]))

"""The device mesh from the config's `mesh` section, and multi-host start-up.

Mesh axes, always in this order (outermost first):

  stage   pipeline parallelism: the scanned layer stack cut into contiguous stages, one
          per stage index, microbatches passed stage to stage (parallel/pipeline.py);
          outermost, so `dcn_stage` puts whole stages on slices and only the stage
          transfers cross the data-centre network
  data    pure data parallelism (gradients all-reduced)
  fsdp    data parallelism with parameters sharded along "embed" (ZeRO-3)
  context context parallelism: activations split along the sequence ("length"),
          attention by ring (parallel/context.py); parameters replicated over it
  tensor  Megatron tensor parallelism (heads, mlp, vocab)
  expert  expert parallelism for MoE; the dense layers use it as more data parallelism

Sizes come from `mesh.stage`, `mesh.data`, `mesh.fsdp`, `mesh.context`, `mesh.tensor` and
`mesh.expert`. One of them may be -1, and it takes up the devices that the others leave.
Keys that are missing count as 1, so `{"fsdp": -1}` is a complete config. `mesh.dcn_<axis>` sizes split an axis
across slices (TPU multi-slice) or processes (a GPU cluster) joined by the slower data-centre
network: the mesh then has size `<axis> * dcn_<axis>` along that axis, and the
`<axis>` sizes (with their -1) describe one slice. When every dcn size is 1, as on any
single host, the mesh is a plain `jax.make_mesh` mesh.

Every axis is `AxisType.Auto`. JAX 0.10's `jax.make_mesh` defaults to `Explicit`,
where shardings are part of array types and an op whose output sharding is
ambiguous raises an error. Linen's `with_logical_constraint` and `LogicallyPartitioned`
only add sharding hints and leave the rest to GSPMD propagation, and so does the
einsum model code. That is Auto mode, so we ask for it explicitly rather than
relying on the default.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils

AXES = ("stage", "data", "fsdp", "context", "tensor", "expert")
DCN_AXES = tuple(f"dcn_{a}" for a in AXES)


def _size(mesh_cfg: Any, key: str, allow_fill: bool) -> int:
  value = mesh_cfg.get(key, 1)
  value = 1 if value is None else value
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise ValueError(f"mesh.{key}={value!r}: must be an int")
  if value < 1 and not (allow_fill and value == -1):
    allowed = "a positive int or -1" if allow_fill else "a positive int"
    raise ValueError(f"mesh.{key}={value}: must be {allowed}")
  return int(value)


def _ici_dcn_shapes(mesh_cfg: Any, num_devices: int) -> tuple[list[int], list[int]]:
  """Per-slice (ICI) and across-slice (DCN) sizes, in AXES order, -1 resolved."""
  unknown = sorted(set(mesh_cfg.keys()) - set(AXES) - set(DCN_AXES))
  if unknown:
    raise ValueError(f"mesh: unknown keys {unknown}; allowed: {list(AXES + DCN_AXES)}")
  dcn = [_size(mesh_cfg, k, allow_fill=False) for k in DCN_AXES]
  num_slices = math.prod(dcn)
  if num_devices % num_slices:
    raise ValueError(f"mesh: dcn sizes {dict(zip(DCN_AXES, dcn))} multiply to {num_slices}, "
                     f"which does not divide the {num_devices} devices")
  per_slice = num_devices // num_slices
  where = f"{per_slice} devices per slice" if num_slices > 1 else f"{num_devices} devices"
  ici = [_size(mesh_cfg, k, allow_fill=True) for k in AXES]
  shown = ", ".join(f"{a}={s}" for a, s in zip(AXES, ici))
  fills = [a for a, s in zip(AXES, ici) if s == -1]
  if len(fills) > 1:
    raise ValueError(f"mesh: only one axis may be -1, got {fills} ({shown})")
  known = math.prod(s for s in ici if s != -1)
  if fills:
    if per_slice % known:
      raise ValueError(f"mesh sizes {shown}: the fixed sizes multiply to {known}, which does "
                       f"not divide the {where}, so {fills[0]}=-1 cannot fill them")
    ici[AXES.index(fills[0])] = per_slice // known
  elif known != per_slice:
    raise ValueError(f"mesh sizes {shown} multiply to {known}, but there are {where}")
  return ici, dcn


def mesh_shape(mesh_cfg: Any, num_devices: int) -> dict[str, int]:
  """Total size of each mesh axis (ICI size times DCN size), with -1 resolved."""
  ici, dcn = _ici_dcn_shapes(mesh_cfg, num_devices)
  return {a: i * d for a, i, d in zip(AXES, ici, dcn)}


def make_mesh(mesh_cfg: Any, devices: Sequence[Any] | None = None) -> jax.sharding.Mesh:
  """The AXES ("stage", "data", "fsdp", "context", "tensor", "expert") mesh over `devices` (default: all)."""
  devices = list(jax.devices() if devices is None else devices)
  ici, dcn = _ici_dcn_shapes(mesh_cfg, len(devices))
  axis_types = (jax.sharding.AxisType.Auto,) * len(AXES)
  if math.prod(dcn) == 1:
    try:
      return jax.make_mesh(ici, AXES, axis_types=axis_types, devices=devices)
    except NotImplementedError:  # E.g. fsdp 64 x tensor 4 on a 16x16 v6e slice: split
      device_array = mesh_utils.create_device_mesh(  # a physical axis (MaxText's
          ici, devices, allow_split_physical_axes=True)  # allow_split_physical_axes).
      return jax.sharding.Mesh(device_array, AXES, axis_types=axis_types)
  # TPUs name their slice; GPU and CPU hosts don't, so there the process is the unit.
  slices = {getattr(d, "slice_index", 0) for d in devices}
  by_process = len(slices) == 1
  granules = len({d.process_index for d in devices}) if by_process else len(slices)
  if granules != math.prod(dcn):
    unit = "processes" if by_process else "slices"
    raise ValueError(f"mesh: dcn sizes {dict(zip(DCN_AXES, dcn))} multiply to "
                     f"{math.prod(dcn)}, but the devices span {granules} {unit}")
  device_array = mesh_utils.create_hybrid_device_mesh(
      ici, dcn, devices, process_is_granule=by_process,
      allow_split_physical_axes=True)  # Only where no whole-axis assignment exists.
  return jax.sharding.Mesh(device_array, AXES, axis_types=axis_types)


def detect_launcher(environ: Mapping[str, str] | None = None) -> str | None:
  """Which multi-process launcher started us ("tpu", "slurm", "openmpi"), or None.

  Reads only environment variables, so it is safe before JAX has started.
  """
  env = os.environ if environ is None else environ

  def count(key: str) -> int:
    try:
      return int(env.get(key, "1"))
    except ValueError:
      return 1

  hosts = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES") or ""
  if env.get("MEGASCALE_COORDINATOR_ADDRESS") or len(hosts.split(",")) > 1:
    return "tpu"
  if count("SLURM_NTASKS") > 1 and "SLURM_PROCID" in env:
    return "slurm"
  if count("OMPI_COMM_WORLD_SIZE") > 1:
    return "openmpi"
  return None


def maybe_initialize_distributed(coordinator_address: str | None = None,
                                 num_processes: int | None = None,
                                 process_id: int | None = None) -> bool:
  """Starts `jax.distributed` when there is more than one process; True if it runs.

  Explicit arguments win (a coordinator address, or `num_processes > 1`); otherwise
  a TPU pod, SLURM job (SLURM_NTASKS > 1) or Open MPI job is detected from the
  environment and JAX fills in the rest itself. A single process does nothing.
  Call it first: `jax.distributed.initialize` must run before any other JAX call
  that touches devices.
  """
  if jax.distributed.is_initialized():
    return True
  explicit = coordinator_address is not None or (num_processes or 1) > 1
  if not explicit and detect_launcher() is None:
    return False
  # CPU processes need a cross-process collectives library; gloo ships with jaxlib.
  # It only affects the CPU client, so it is harmless next to GPUs or TPUs.
  if "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in os.environ:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes, process_id=process_id)
  return True

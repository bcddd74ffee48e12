"""TPU topologies that are not attached: their devices (from libtpu) and their chips'
published figures (HBM, peak FLOP/s, HBM and inter-chip bandwidth).

A topology is named as libtpu names it, `<generation>:<chips per axis>` ("v5e:2x2",
"v5p:4x4x4", "v6e:16x16"), or as Cloud TPU sells it, `<generation>-<count>`
("v5e-16", "v5p-128", "v6e-256"): v5e and v6e count chips, v5p counts TensorCores
(two per chip), so v5p-128 is the 64 chips of v5p:4x4x4.

Figures are per chip, bfloat16, from the Cloud TPU system-architecture pages
(cloud.google.com/tpu/docs/v5e, /v5p, /v6e). v4 is left out: libtpu counts its
devices per TensorCore pair differently from its chips, unchecked here.; ICI is the per-chip inter-chip
interconnect bandwidth those pages give (Gbps / 8).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

GiB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class Chip:
  generation: str  # libtpu's name: "v5e", "v5p", ...
  hbm_bytes: int
  peak_flops: float  # bfloat16 matmul FLOP/s.
  hbm_bandwidth: float  # bytes/s.
  ici_bandwidth: float  # bytes/s per chip, all links.
  cores_per_chip: int  # What the `-<count>` product name counts per chip.
  dims: int  # Topology rank: 2 (a 2D torus) or 3.
  # What XLA:TPU lets a program use (its "exceeds available HBM (15.75G)"): the one
  # capacity every verdict compares against (train/aot/report.py), fitting or not.
  usable_hbm_bytes: int = 0
  # int8 x int8 matmul OP/s (the MXU's int8 mode: 2x bfloat16 on v5e and v6e); 0: none.
  # None of these chips multiplies float8 natively: XLA:TPU runs fp8 dots in bfloat16.
  int8_peak_flops: float = 0.0


CHIPS: dict[str, Chip] = {
    # Usable HBM: v5e and v5p as libtpu's refusals state it (15.75G, 95.74G); v6e
    # assumed to keep the same ~0.25 GiB back (not yet seen in a refusal).
    "v5e": Chip("v5e", 16 * GiB, 197e12, 819e9, 1600e9 / 8, 1, 2, int(15.75 * GiB), 394e12),
    "v5p": Chip("v5p", 96 * GiB, 459e12, 2765e9, 4800e9 / 8, 2, 3, int(95.74 * GiB), 918e12),
    "v6e": Chip("v6e", 32 * GiB, 918e12, 1640e9, 3584e9 / 8, 1, 2, int(31.75 * GiB), 1836e12),
}
@dataclasses.dataclass(frozen=True)
class Links:
  """A chip's two slow links, bytes/s per chip (train/aot/estimate.py)."""
  host: float  # Host link (PCIe): what an offloading remat policy's copies cross.
  dcn: float  # Data-centre network: what crosses between slices.
  source: str


# DCN: the per-host NICs over the chips per host (v5e 2 x 100 Gbps / 8 chips, v6e
# 4 x 200 Gbps / 8) or the per-chip figure (v5p: 50 Gbps), from the Cloud TPU
# system-architecture pages (cloud.google.com/tpu/docs/v5e, /v5p, /v6e), Gbps / 8.
# Host link: 1.5e10 bytes/s per chip, the PCIe figure of "How to Scale Your Model"
# (jax-ml.github.io/scaling-book/tpus, v6e); no per-chip figure is published for v5e or
# v5p, so theirs is ASSUMED the same.
LINKS: dict[str, Links] = {
    "v5e": Links(1.5e10, 2 * 100e9 / 8 / 8, "DCN: 2 x 100 Gbps NICs per 8-chip host; "
                 "host link: v6e's PCIe figure, assumed"),
    "v5p": Links(1.5e10, 50e9 / 8, "DCN: 50 Gbps per chip; host link: v6e's PCIe "
                 "figure, assumed"),
    "v6e": Links(1.5e10, 4 * 200e9 / 8 / 8, "DCN: 4 x 200 Gbps NICs per 8-chip host; "
                 "host link: PCIe, 1.5e10 bytes/s (scaling book)"),
}


def links(chip: Chip) -> Links:
  """The host-link and DCN bandwidths per chip of `chip`'s generation."""
  if chip.generation not in LINKS:
    raise ValueError(f"no host / DCN bandwidth known for TPU {chip.generation}: "
                     f"known {sorted(LINKS)} (train/aot/topology.py LINKS)")
  return LINKS[chip.generation]


# Shapes of the product names this project's docs use, for the error message.
EXAMPLES = ("v5e:2x2", "v5e:4x4", "v5p:4x4x2", "v5p:4x4x4", "v5p:8x8x8", "v6e:16x16",
            "v5e-16", "v5p-64", "v6e-256", "v5p-1024")


@dataclasses.dataclass(frozen=True)
class Topology:
  name: str  # libtpu's: "v5p:4x4x4".
  chip: Chip
  shape: tuple[int, ...]  # Chips per axis of one slice.
  num_slices: int = 1

  @property
  def chips_per_slice(self) -> int:
    return math.prod(self.shape)

  @property
  def num_chips(self) -> int:
    return self.chips_per_slice * self.num_slices

  def describe(self) -> str:
    slices = f" x {self.num_slices} slices" if self.num_slices > 1 else ""
    return f"{self.name}{slices} ({self.num_chips} chips of TPU {self.chip.generation})"


def _unknown(name: str, why: str) -> ValueError:
  return ValueError(f"--topology {name!r}: {why}. Known generations: {sorted(CHIPS)}; "
                    f"e.g. {', '.join(EXAMPLES)}")


def _product_shape(chip: Chip, chips: int) -> tuple[int, ...]:
  """The slice shape of `chips` chips, as near a cube (square) as powers of two allow."""
  if chips < 1 or chips & (chips - 1):
    raise _unknown(f"{chip.generation}-{chips * chip.cores_per_chip}",
                   "only power-of-two slices are known by product name; give the shape")
  shape = [1] * chip.dims
  for i in range(int(math.log2(chips))):
    shape[i % chip.dims] *= 2
  return tuple(sorted(shape))


def parse_topology(name: str, num_slices: int = 1) -> Topology:
  """`name` -> Topology; an unknown generation or a malformed name lists the known ones."""
  if num_slices < 1:
    raise ValueError(f"--num_slices={num_slices}: must be >= 1")
  m = re.fullmatch(r"(v\d+[a-z]*)([:-])([0-9x]+)", name.strip())
  if not m:
    raise _unknown(name, "not a topology name")
  gen, sep, rest = m.groups()
  if gen not in CHIPS:
    raise _unknown(name, f"unknown TPU generation {gen!r}")
  chip = CHIPS[gen]
  if sep == "-":
    if not rest.isdigit() or int(rest) % chip.cores_per_chip:
      raise _unknown(name, f"{gen}-N counts {'TensorCores' if chip.cores_per_chip > 1 else 'chips'}")
    shape = _product_shape(chip, int(rest) // chip.cores_per_chip)
  else:
    parts = rest.split("x")
    if len(parts) != chip.dims or not all(p.isdigit() and int(p) > 0 for p in parts):
      example = "x".join(["4"] * chip.dims)
      raise _unknown(name, f"TPU {gen} slices have {chip.dims} axes, e.g. {gen}:{example}")
    shape = tuple(int(p) for p in parts)
  return Topology(f"{gen}:{'x'.join(map(str, shape))}", chip, shape, num_slices)


def prepare_host() -> None:
  """Call before anything touches a JAX backend. libtpu, once installed, makes JAX look
  for an attached TPU at start-up (seconds, and errors on a CPU host); the compile
  needs none, so JAX starts on the CPU unless JAX_PLATFORMS says otherwise. libtpu is
  told there is no TPU VM metadata to query, which also silences its warnings.
  Environment variables only set defaults: a TPU VM's own settings win."""
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  # libtpu takes a machine-wide lock (/tmp/libtpu_lockfile) for the chips it would
  # drive; compiling drives none, so compiles may run side by side (tests, a table).
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  import jax  # pylint: disable=g-import-not-at-top
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  if not os.environ.get("JAX_PLATFORMS") and not xla_bridge.backends_are_initialized():
    jax.config.update("jax_platforms", "cpu")
  # A compile-only executable cannot be loaded back without a TPU client: caching it
  # persistently only writes entries that every later read rejects with a warning.
  jax.config.update("jax_enable_compilation_cache", False)


def libtpu_available() -> bool:
  import importlib.util  # pylint: disable=g-import-not-at-top
  return importlib.util.find_spec("libtpu") is not None


def topology_devices(topo: Topology) -> list:
  """The compile-only devices of `topo` (all slices): jit over a mesh of them compiles
  for TPU on any host. Needs libtpu: `pip install -e '.[tpu-aot]'`."""
  if not libtpu_available():
    raise RuntimeError("--mode compile needs libtpu, the TPU compiler: "
                       "pip install -e '.[tpu-aot]' (or `make test-aot`)")
  prepare_host()
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  desc = topologies.get_topology_desc(topology_name=topo.name, platform="tpu",
                                      num_slices=topo.num_slices)
  devices = list(desc.devices)
  if len(devices) != topo.num_chips:
    raise ValueError(f"libtpu gave {len(devices)} devices for {topo.describe()}")
  return devices

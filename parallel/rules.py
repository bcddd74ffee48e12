"""THE logical-axis rules table: logical name -> mesh axes. Nothing else maps names.

Model code names array dimensions with the logical names below (parameters via
`nn.with_logical_partitioning`, activations via `nn.with_logical_constraint`); this
table turns them into mesh axes:

  logical   mesh axes                   why
  batch     ("data", "fsdp", "expert",  every data-like axis splits the batch; the
             "stage")                   expert axis too, so outside the MoE layers the
                                        devices of one expert group don't do the
                                        same work twice (GShard / MaxText); and the
                                        stage axis, so outside the pipeline (embedding,
                                        final norm, head, loss) each stage does its
                                        share of the rows, not all of them
  length    "context"                   context parallelism: each context index holds
                                        its slice of the sequence, attention passes
                                        K/V around a ring (parallel/context.py)
  embed     ("fsdp", "expert")          ZeRO-3: parameters split along D, gathered
                                        per layer by GSPMD; over the expert axis too
                                        (MaxText's embed), so an MoE model's weights
                                        outside its experts (embedding, head,
                                        attention, dense and shared FFNs, router) are
                                        split over every chip of fsdp x expert
  expert_embed "fsdp"                   the routed experts' own D: their expert dim
                                        holds the expert axis (MaxText's embed_no_exp)
  heads     "tensor"                    Megatron attention (replicated if N % tensor)
  kv_heads  "tensor"                    replicated if K % tensor (e.g. MQA, small GQA)
  head_dim  None
  latent    ("fsdp", "expert")          MLA's q / kv latents (model/attention/mla.py): the
                                        up-projections ("latent", "heads", "head_dim") are
                                        ZeRO-3-split along their latent rows, as MaxText does
                                        (without it they are whole on every chip: DeepSeek-V3's
                                        are 3.2B parameters); where "embed" or "batch" already
                                        holds fsdp (down-projections, activations) the latent
                                        stays whole; over expert too, as embed
  residual  "tensor"                    the residual stream's D between layers (each layer's
                                        input, what remat saves and offloads): split over the
                                        tensor axis, so a tensor group's chips do not each hold
                                        the same [B, L, D] (MaxText's activation_embed);
                                        gathered inside the layer where attention and the FFN
                                        read it whole. Without it a 405B layer input at 4
                                        sequences x 8192 per tensor group is 1 GiB per chip
  mlp       "tensor"                    Megatron FFN (column then row parallel)
  vocab     "tensor"                    embedding and logits split over the vocabulary
  expert    "expert"                    one group of experts per expert-axis index
  layers    "stage"                     the scanned layer stack: contiguous blocks of
                                        layers per pipeline stage (parallel/pipeline.py);
                                        whole without a stage axis

No activation is named "layers", so "stage" splits the stacked layer parameters (and their
optimizer moments) and, through "batch", the activations outside the pipeline. Inside the
pipeline's shard_map the stage axis is manual, so no rule may name it there:
`without_axis("stage")` is the table in force inside (parallel/pipeline.py), every
activation rule then mapping to the Auto axes only.

Axes of size 1 are dropped, so a data-only mesh gives fully replicated parameters
and specs never name an axis that does nothing. No parameter dimension is named
"length", so parameters are replicated over "context" (as over "data").

Activations use the same "embed" as parameters. There is no conflict with "batch"
on the fsdp axis: flax gives each mesh axis to the first rule (in table order)
that asks for it and leaves a dimension unsharded when its axes are taken. "batch"
comes first, so ("batch", "length", "embed") -> (("data", "fsdp"), None, None)
while the ("embed", "mlp") kernel -> ("fsdp", "tensor"). The order is pinned by
tests/parallel/test_rules.py. For the same reason a dimension named "expert" in an
activation that also has "batch" is not sharded (batch already holds the expert
axis); MoE tensors laid out per expert, e.g. ("expert", None, "expert_embed"), are. A
rule's axes are taken all or none, so the experts' D has its own name: "embed" there
would find the expert axis held and stay whole, not split over fsdp.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax

from parallel import mesh as mesh_lib

Rules = tuple[tuple[str, "str | tuple[str, ...] | None"], ...]

# The mesh axes that split the batch, in order ("batch" below; parallel/expert.py makes the
# ones of size > 1 manual around expert-parallel dispatch, so each device sees its own rows).
# "stage" last (minor): a device's rows are then a contiguous block of its data-parallel
# group's rows, which the pipeline's last stage scatters over the stages (parallel/pipeline.py).
BATCH_AXES = ("data", "fsdp", "expert", "stage")

LOGICAL_NAMES = ("batch", "length", "embed", "residual", "heads", "kv_heads", "head_dim",
                 "latent", "mlp",
                 "vocab", "expert", "expert_embed", "layers")

# Named strategies as mesh configs (missing keys are 1); each fits any device count
# that its fixed sizes divide. The golden test pins what each does to a model.
PRESETS: dict[str, dict[str, int]] = {
    "dp": {"data": -1},
    "fsdp": {"fsdp": -1},
    "tp": {"tensor": -1},
    "dp_fsdp_tp": {"data": -1, "fsdp": 2, "tensor": 2},
    "ep": {"expert": -1},
    "dp_cp": {"data": -1, "context": 4},
}


def _divides(size: int, count: int | None) -> bool:
  return count is None or count % size == 0


def logical_rules(mesh_cfg: Any = None, num_kv_heads: int | None = None,
                  num_heads: int | None = None,
                  mesh: jax.sharding.Mesh | None = None) -> Rules:
  """The rules table for a mesh, as flax's `(logical name, mesh axes)` pairs.

  Axis sizes come from `mesh` when given, else from `mesh_cfg` on all devices.
  `num_heads` / `num_kv_heads`, when given, replicate the (KV) heads whose count
  the tensor axis does not divide instead of failing to shard them.
  """
  if mesh is not None:
    sizes = dict(mesh.shape)
  elif mesh_cfg is not None:
    sizes = mesh_lib.mesh_shape(mesh_cfg, jax.device_count())
  else:
    raise ValueError("logical_rules needs mesh_cfg or mesh")
  for count, field in ((num_heads, "num_heads"), (num_kv_heads, "num_kv_heads")):
    if count is not None and count < 1:
      raise ValueError(f"{field}={count}: must be a positive int")

  def axes(*names: str) -> str | tuple[str, ...] | None:
    kept = tuple(n for n in names if sizes.get(n, 1) > 1)
    return None if not kept else kept[0] if len(kept) == 1 else kept

  tensor = sizes.get("tensor", 1)
  return (  # "batch" first: see the module docstring.
      ("batch", axes(*BATCH_AXES)),
      ("length", axes("context")),
      ("embed", axes("fsdp", "expert")),
      ("residual", axes("tensor")),
      ("heads", axes("tensor") if _divides(tensor, num_heads) else None),
      ("kv_heads", axes("tensor") if _divides(tensor, num_kv_heads) else None),
      ("head_dim", None),
      ("latent", axes("fsdp", "expert")),
      ("mlp", axes("tensor")),
      ("vocab", axes("tensor")),
      ("expert", axes("expert")),
      ("expert_embed", axes("fsdp")),
      ("layers", axes("stage")),
  )


@contextlib.contextmanager
def without_axis(axis: str) -> Iterator[None]:
  """The rules in force (flax's logical_axis_rules context) with `axis` dropped from every
  entry, for code traced inside a shard_map where `axis` is manual (a sharding constraint
  may not name a manual axis): e.g. "batch" -> ("data", "stage") becomes "data"."""
  def drop(axes):
    kept = tuple(a for a in ((axes,) if isinstance(axes, str) else axes or ()) if a != axis)
    return None if not kept else kept[0] if len(kept) == 1 else kept
  with nn.logical_axis_rules(tuple((name, drop(axes))
                                   for name, axes in nn.get_logical_axis_rules())):
    yield


def row_blocks_before(axis: str) -> int:
  """Under the rules in force: into how many contiguous row blocks the "batch" rule's mesh
  axes before `axis` cut the batch, when "batch" names `axis` last (its minor axis, as the
  table does with "stage"); 0 where it does not (no rules, no such axis)."""
  if not nn.get_logical_axis_rules():
    return 0
  axes = nn.logical_to_mesh_axes(("batch",))[0]
  axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
  if not axes or axes[-1] != axis:
    return 0
  mesh = jax.sharding.get_abstract_mesh()
  return math.prod(int(mesh.shape[a]) for a in axes[:-1])

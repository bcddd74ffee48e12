"""Remat policies by name (ModelConfig.remat): MaxText's names and meanings.

Each block tags its tensors with `jax.ad_checkpoint.checkpoint_name` (TENSORS: where in
model/attention/gqa.py, mla.py, model/layers.py FeedForward and the MoE's expert FFN in
model/moe/dispatch.py). A policy says which tagged tensors the backward pass keeps in
device memory, which it offloads to host memory (`pinned_host`) and brings back, and
recomputes everything else from the block's input (`nn.remat` around each Block, in the
layer loop: model/transformer.py). docs/model.md, "Remat policies", has the table and
the compiled TPU memory of each.

  none     nothing recomputed (no nn.remat at all)
  custom   ModelConfig.remat_custom: "decoder_layer_input=offload,query_proj=device,..."
           each tensor remat | device | offload (an unnamed tensor: remat)

On CPU host and device memory are the same RAM: an offloading policy keeps those
tensors on device instead (the same numbers, no copies), and says so once in the log.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import jax

from model import backend as target

# The tagged tensors (MaxText's names). qkv_proj is MaxText's fused q/k/v projection:
# blockwork projects q, k and v apart, so the name tags nothing; it is accepted so a
# MaxText policy map reads as it is.
TENSORS = {
    "decoder_layer_input": "the block's input x_BLD (the residual stream)",
    "query_proj": "queries as attention reads them (projected, biased, normed, rotated)",
    "key_proj": "keys as attention reads them (MLA: expanded per head, rope key joined)",
    "value_proj": "values as attention reads them (MLA: expanded per head)",
    "qkv_proj": "MaxText's fused q/k/v projection: none in blockwork, tags nothing",
    "context": "attention's output before the output projection, out_BLNH",
    "out_proj": "the output projection's out_BLD",
    "mla_q": "MLA's normalised query latent cq_BLQ (q_lora_rank > 0)",
    "mla_kv": "MLA's normalised KV latent c_BLA",
    "mlpwi": "an ungated FFN's x wi before the nonlinearity (MoE experts too)",
    "mlpwi_0": "a gated FFN's gate x wg before the nonlinearity (MoE experts too)",
    "mlpwi_1": "a gated FFN's linear x wi (MoE experts too)",
    "mlpwo": "the FFN's output projection (MoE experts: before the gate-weighted combine)",
}
LOCATIONS = ("remat", "device", "offload")  # remat_custom's values.

_QKV = ("query_proj", "key_proj", "value_proj", "qkv_proj")
_MLP = ("mlpwi", "mlpwi_0", "mlpwi_1", "mlpwo")
_MINIMAL = _QKV + ("out_proj",) + _MLP
# name -> (tensors kept on device, tensors offloaded to host), MaxText's get_remat_policy.
NAMED: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "minimal_with_context": (_MINIMAL + ("context",), ()),
    "minimal": (_MINIMAL, ()),
    "save_dot_except_mlp": (_QKV + ("out_proj",), ()),
    "save_qkv_proj": (_QKV, ()),
    "save_out_proj": (("out_proj",), ()),
    "minimal_offloaded": ((), _MINIMAL),
    "qkv_proj_offloaded": ((), _QKV[:3]),
    "full": ((), ()),
}
# Every ModelConfig.remat value. save_dots (blockwork's older name): every matmul without
# batch dims (jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims, MaxText's old
# "minimal"): the projections and the FFN, not the attention scores.
NAMES = ("none", "save_dots", *NAMED, "custom")
OFFLOAD_SRC, OFFLOAD_DST = "device", "pinned_host"

log = logging.getLogger(__name__)


def parse_custom(spec: str) -> dict[str, str]:
  """"name=where,..." -> {name: where}; ValueError naming the bad entry."""
  out: dict[str, str] = {}
  for item in (s.strip() for s in spec.split(",")):
    if not item:
      continue
    name, sep, where = (t.strip() for t in item.partition("="))
    if not sep:
      raise ValueError(f"entry {item!r} is not tensor=where (where one of {LOCATIONS})")
    if name not in TENSORS:
      raise ValueError(f"unknown tensor {name!r} (known: {', '.join(TENSORS)})")
    if where not in LOCATIONS:
      raise ValueError(f"{name}={where!r}: must be one of {LOCATIONS}")
    if name in out:
      raise ValueError(f"tensor {name!r} given twice")
    out[name] = where
  return out


def placement(remat: str, custom: str = "") -> tuple[tuple[str, ...], tuple[str, ...]]:
  """(tensors kept on device, tensors offloaded) of a named policy or a custom map."""
  if remat == "custom":
    where = parse_custom(custom)
    return (tuple(n for n, w in where.items() if w == "device"),
            tuple(n for n, w in where.items() if w == "offload"))
  if remat not in NAMED:
    raise ValueError(f"remat={remat!r} names no tensors (one of {tuple(NAMED)}, or custom)")
  return NAMED[remat]


@functools.cache
def _say_offload_degrades() -> None:
  log.warning("model.remat offloads tensors to host memory: on CPU host and device memory "
              "are the same, so they stay on device (the same numbers)")


def policy(remat: str, custom: str = "") -> Callable | None:
  """The jax.checkpoint policy of `remat` ("none" has none: no remat); offloading
  becomes keeping on device when the trace is for CPU (model/backend.py)."""
  if remat == "save_dots":
    return jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims
  save, offload = placement(remat, custom)
  if offload and target.backend() == "cpu":
    _say_offload_degrades()
    save, offload = save + offload, ()
  if not offload:
    return jax.checkpoint_policies.save_only_these_names(*save) if save else None
  return jax.checkpoint_policies.save_and_offload_only_these_names(
      names_which_can_be_saved=list(save), names_which_can_be_offloaded=list(offload),
      offload_src=OFFLOAD_SRC, offload_dst=OFFLOAD_DST)

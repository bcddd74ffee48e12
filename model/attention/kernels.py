"""Vendor attention kernels behind the AttendFn interface: cuDNN (GPU) and Splash (TPU).

Each kernel's arguments are built from the same AttnSpec as the score hook's
(model/attention/scores.py): cuDNN gets the segment mask, the causal window and the sum
of the hook's biases as a dense bias; Splash gets causal / local mask objects, segment
ids and the soft-cap. What a kernel cannot express is refused by name: `kernel_gaps(impl,
spec)` at call time, and `unsupported(impl, cfg)` (the same gaps plus dtype and head
width) by ModelConfig.validate (an explicit choice the kernel cannot serve fails where
the config is built) and by `resolve_attention_impl` ("auto" only picks a kernel that
serves the config). The backend is checked at trace time: a config can be written on a
laptop for a GPU or TPU run.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from model import backend as target
from model.attention import scores
from model.attention.reference import AttnData, AttnSpec, check_self_attention, whole_tile
from model.attention.scores import spec_from_config

SPLASH_BLOCKS = (512, 256, 128)  # Largest that divides the padded length; Splash needs 128 | L.


def kernel_gaps(impl: str, spec: AttnSpec) -> list[str]:
  """What of `spec` the kernel `impl` cannot express (empty: it can), each naming its field."""
  reasons = []
  if impl == "cudnn" and spec.softcap:
    reasons.append(f"attn_logit_softcap={spec.softcap}: cuDNN flash attention has no logit "
                   "soft-cap (use 'blockwise', or 'splash' on TPU)")
  if impl == "splash":
    reasons += [f"{bias.source}: the Splash kernel takes no additive bias (use 'blockwise')"
                for bias in scores.active_biases(spec)]
  return reasons


def unsupported(impl: str, cfg) -> list[str]:
  """Why `impl` cannot run `cfg` (empty: it can), each naming the field."""
  reasons = kernel_gaps(impl, spec_from_config(cfg))
  if impl == "cudnn":
    if cfg.dtype != "bfloat16":
      reasons.append(f"dtype={cfg.dtype!r}: cuDNN flash attention needs bfloat16 compute")
    H = cfg.resolved_head_dim
    if cfg.attention_type == "mla":  # model/attention/mla.py pads q / k / v to one width.
      _, _, nope, rope, v = cfg.mla_dims
      H = max(nope + rope, v)
    if H % 8 or H > 128:
      reasons.append(f"head_dim={H}: cuDNN flash attention needs a multiple of 8, at most 128")
  return reasons


def _refuse_gaps(impl: str, spec: AttnSpec):
  reasons = kernel_gaps(impl, spec)
  if reasons:
    raise ValueError(f"attention_impl={impl!r}: " + "; ".join(reasons))


def _check_backend(impl: str, needs: str):
  backend = target.backend()
  if backend != needs:
    raise ValueError(f"attention_impl={impl!r} needs a {needs.upper()}; this backend is "
                     f"{backend} (use 'auto', 'blockwise' or 'xla')")


def cudnn_attention(q_BLKGH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, data: AttnData,
                    spec: AttnSpec, implementation: str = "cudnn") -> jax.Array:
  """jax.nn.dot_product_attention with cuDNN's fused kernel; out_BLKGH.

  cuDNN's public entry has no segment ids, so they go in as a boolean mask_B1LS
  (one [L, S] per sequence, not per head); the score hook's biases (ALiBi) go in as
  one dense bias_BNLS.
  `implementation="xla"` runs the same translation through XLA, so its
  arguments are testable on any backend.
  """
  if implementation == "cudnn":
    _check_backend("cudnn", "gpu")
  _refuse_gaps("cudnn", spec)
  check_self_attention("cudnn", q_BLKGH, k_BSKH, v_BSKH, data)
  B, L, K, G, H = q_BLKGH.shape
  same_doc_B1LS = (data.q_segment_ids_BL[:, :, None] ==
                   data.kv_segment_ids_BS[:, None, :])[:, None]
  bias_BKGLS = scores.bias_BKGLS(spec, whole_tile(data, L, L), K, G)
  bias_BNLS = None if bias_BKGLS is None else bias_BKGLS.reshape(B, K * G, L, L).astype(
      q_BLKGH.dtype)
  window = (spec.sliding_window - 1, 0) if spec.sliding_window else None
  out_BLNH = jax.nn.dot_product_attention(
      q_BLKGH.reshape(B, L, K * G, H), k_BSKH, v_BSKH, bias=bias_BNLS, mask=same_doc_B1LS,
      scale=spec.scale, is_causal=True, local_window_size=window,
      implementation=implementation)
  return out_BLNH.reshape(B, L, K, G, H)


# Not cached: the kernel holds its mask tables as jnp arrays made in the trace that built
# it, so a kernel kept from one trace leaks that trace's tracers into the next (the
# layer scan, the backward pass; it failed so when first compiled for TPU, train/aot/).
# Building them eagerly instead (ensure_compile_time_eval) fails under a mesh of
# compile-only TPU devices. The tables are numpy work over the block grid, small next to
# a trace.
def _splash_kernel(num_heads: int, length: int, window: int, softcap: float, interpret: bool):
  # Imported here: the Pallas TPU modules are only needed where Splash runs.
  from jax.experimental.pallas.ops.tpu.splash_attention import (  # pylint: disable=g-import-not-at-top
      splash_attention_kernel as sk, splash_attention_mask as sm)
  shape = (length, length)
  head = sm.LocalMask(shape, (window - 1, 0), offset=0) if window else sm.CausalMask(shape)
  block = next(b for b in SPLASH_BLOCKS if length % b == 0)
  sizes = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                        block_q_dq=block, block_kv_dq=block)
  return sk.make_splash_mha(sm.MultiHeadMask([head] * num_heads), block_sizes=sizes,
                            attn_logits_soft_cap=softcap or None, head_shards=1,
                            q_seq_shards=1, interpret=interpret), sk.SegmentIds


def splash_attention(q_BLKGH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, data: AttnData,
                     spec: AttnSpec, interpret: bool = False) -> jax.Array:
  """The Pallas TPU Splash kernel (GQA, causal / local mask, segment ids, soft-cap).

  `interpret=True` runs the kernel in the Pallas interpreter on any backend (slow;
  for tests). The length is padded to a multiple of 128 with a segment id of its
  own; padded rows see themselves, so no row of the mask is empty.

  Under a mesh (jax.set_mesh) the kernel runs in a shard_map: Mosaic kernels cannot be
  partitioned by GSPMD. Rows split like the "batch" rule, heads like "kv_heads" (each
  device then holds whole query groups); an axis whose size does not divide the rows or
  the KV heads (MQA on a tensor axis) keeps them whole: every device on it computes all.
  """
  if not interpret:
    _check_backend("splash", "tpu")
  _refuse_gaps("splash", spec)
  check_self_attention("splash", q_BLKGH, k_BSKH, v_BSKH, data)
  local = functools.partial(_splash_local, spec=spec, interpret=interpret)
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return local(q_BLKGH, k_BSKH, v_BSKH, data.q_segment_ids_BL, data.kv_segment_ids_BS)
  batch, heads = (_dividing(axes, n, mesh) for axes, n in zip(
      nn.logical_to_mesh_axes(("batch", "kv_heads")), (q_BLKGH.shape[0], q_BLKGH.shape[2])))
  P = jax.sharding.PartitionSpec
  qkv, rows = P(batch, None, heads), P(batch)
  return jax.shard_map(local, mesh=mesh, in_specs=(qkv, qkv, qkv, rows, rows), out_specs=qkv,
                       check_vma=False)(q_BLKGH, k_BSKH, v_BSKH, data.q_segment_ids_BL,
                                        data.kv_segment_ids_BS)


def _dividing(axes, n: int, mesh):
  """`axes` (a rule's mesh axes) if their size divides n, else None (kept whole)."""
  names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
  return axes if n % math.prod(mesh.shape[a] for a in names) == 0 else None


def _splash_local(q_BLKGH, k_BSKH, v_BSKH, q_segment_ids_BL, kv_segment_ids_BS, *,
                  spec: AttnSpec, interpret: bool) -> jax.Array:
  B, L, K, G, H = q_BLKGH.shape
  Lp = -(-L // SPLASH_BLOCKS[-1]) * SPLASH_BLOCKS[-1]
  kernel, segment_ids = _splash_kernel(K * G, Lp, spec.sliding_window, float(spec.softcap),
                                       interpret)
  pad = lambda x, value=0: jnp.pad(x, [(0, 0), (0, Lp - L)] + [(0, 0)] * (x.ndim - 2),
                                   constant_values=value)
  # The kernel takes [heads, length, head_dim] per sequence and does not scale q.
  q_BNLH = pad(q_BLKGH * jnp.asarray(spec.scale, q_BLKGH.dtype)).reshape(
      B, Lp, K * G, H).transpose(0, 2, 1, 3)
  k_BKSH, v_BKSH = (pad(x).transpose(0, 2, 1, 3) for x in (k_BSKH, v_BSKH))
  seg = segment_ids(q=pad(q_segment_ids_BL, -1), kv=pad(kv_segment_ids_BS, -1))
  out_BNLH = jax.vmap(kernel)(q_BNLH, k_BKSH, v_BKSH, segment_ids=seg)
  return out_BNLH.transpose(0, 2, 1, 3)[:, :L].reshape(B, L, K, G, H)

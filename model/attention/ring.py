"""Ring attention ("ring"): the per-shard math of context parallelism.

Under a mesh whose "context" axis has c > 1 devices, q, k, v arrive split along their
length and in the zig-zag token order the whole network runs in (device i holds chunks
i and 2c - 1 - i of 2c; parallel/context.py says why; the Transformer sets the order once
per forward pass, so attention moves no activations). Inside
`parallel.context.shard_over_context` each device keeps its queries and passes its key/value blocks (with their segment ids and positions) around the
ring: after step t it holds those of device i - t. Each step folds the visiting keys into
the queries' online softmax, block pair by block pair with blockwise attention's own
per-block logits (through the score hook, model/attention/scores.py), update and
gradients (model/attention/blockwise.py), so no device holds the
[L, S] scores or more than two devices' K/V at a time. K/V stay grouped by KV head
(GQA / MQA are never repeated to N heads).

Masks follow global slots, so every block pair knows where it sits in the sequence:
causal, sliding windows, segment ids of packed documents, ALiBi (from positions) and the
soft-cap are exactly the reference's. Block pairs wholly above the causal diagonal or
left of the window are skipped (`lax.cond`); with the zig-zag layout every device skips
the same number, so the ring is balanced.

The backward pass is a `custom_vjp` (FlashAttention-2 per block, as blockwise's): the
forward keeps the local q, k, v, output and logsumexp; the backward sends K/V around the
ring again together with their dK, dV accumulators, which arrive home after c steps.
Autodiff through the forward ring would instead keep every visiting K/V block alive,
i.e. the full K/V on every device.

With no context axis (one device, init) the ring has one device: the same math, no
collectives.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from model.attention import blockwise, scores
from model.attention.reference import NEG_INF, AttnData, AttnSpec, check_self_attention
from parallel import context

F32 = jnp.float32


class Ring(NamedTuple):
  """Static layout of one ring call (hashable: a custom_vjp static argument)."""
  size: int  # c devices on the context axis (1: no ring).
  chunk: int  # C tokens per zig-zag chunk; each device holds 2 chunks.


def _device(ring: Ring):
  return jax.lax.axis_index(context.AXIS) if ring.size > 1 else jnp.int32(0)


def _source(ring: Ring, step):
  return context.ring_source(step) if ring.size > 1 else jnp.int32(0)


def _varying(ring: Ring, tree):
  return context.varying(tree) if ring.size > 1 else tree


def _pass(ring: Ring, tree):
  return context.ring_pass(tree) if ring.size > 1 else tree


def _block_slot(ring: Ring, device, index, block: int):
  """Global slot of the first token of local block `index` (of `block` tokens) of
  `device` in the zig-zag layout; blocks never straddle the two chunks."""
  first, second = context.zigzag_chunks(device, ring.size)
  start = index * block
  chunk = jnp.where(start < ring.chunk, first, second)
  return chunk * ring.chunk + start % ring.chunk


def _visible(spec: AttnSpec, q0, k0):
  """Whether any key of the block at slot k0 is within reach of the queries at q0
  (the score hook's causal / window reach, model/attention/scores.py)."""
  first, last = scores.visible_kv_slots(spec, q0, q0 + spec.block_q - 1)
  return (k0 <= last) & (k0 + spec.block_kv - 1 >= first)


def _slice(x, start, size: int, axis: int):
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _update(x, start, new, axis: int):
  return jax.lax.dynamic_update_slice_in_dim(x, new.astype(x.dtype), start, axis=axis)


def _fold_in_keys(spec, ring, q_side, kv_side, src, state):
  """The visiting keys of device `src` folded into every local query row's online
  softmax state (m_BKGL, l_BKGL, acc_BKGLH)."""
  q_BKGLH, qseg_BL, qpos_BL = q_side
  k_BKSH, v_BKSH, kvseg_BS, kvpos_BS = kv_side
  L, bq, bk, me = q_BKGLH.shape[3], spec.block_q, spec.block_kv, _device(ring)

  def q_block(i, state):
    q0, r0 = _block_slot(ring, me, i, bq), i * bq
    qb = _slice(q_BKGLH, r0, bq, 3)
    qsegb, qposb = _slice(qseg_BL, r0, bq, 1), _slice(qpos_BL, r0, bq, 1)

    def kv_step(j, st):
      k0, c0 = _block_slot(ring, src, j, bk), j * bk

      def fold(st):
        kb, vb = _slice(k_BKSH, c0, bk, 2), _slice(v_BKSH, c0, bk, 2)
        s_BKGLS, _ = blockwise._logits(  # pylint: disable=protected-access
            spec, qb, kb, qsegb, _slice(kvseg_BS, c0, bk, 1), qposb,
            _slice(kvpos_BS, c0, bk, 1), q0, k0)
        return blockwise.online_softmax_step(st, s_BKGLS, vb)

      return jax.lax.cond(_visible(spec, q0, k0), fold, lambda st: st, st)

    m, l, acc = state
    st = (_slice(m, r0, bq, 3), _slice(l, r0, bq, 3), _slice(acc, r0, bq, 3))
    mb, lb, accb = jax.lax.fori_loop(0, L // bk, kv_step, st)
    return _update(m, r0, mb, 3), _update(l, r0, lb, 3), _update(acc, r0, accb, 3)

  return jax.lax.fori_loop(0, L // bq, q_block, state)


def _grads_of_keys(spec, ring, q_side, kv_side, src, lse_BKGL, delta_BKGL, do_BKGLH, carry):
  """(dq, dk, dv) contributions of the visiting keys of device `src`, added to `carry`
  (dq of the local queries, dk and dv of the visiting keys; float32)."""
  q_BKGLH, qseg_BL, qpos_BL = q_side
  k_BKSH, v_BKSH, kvseg_BS, kvpos_BS = kv_side
  L, bq, bk, me = q_BKGLH.shape[3], spec.block_q, spec.block_kv, _device(ring)

  def kv_block(j, carry):
    dq, dk, dv = carry
    k0, c0 = _block_slot(ring, src, j, bk), j * bk
    kb, vb = _slice(k_BKSH, c0, bk, 2), _slice(v_BKSH, c0, bk, 2)
    kvsegb, kvposb = _slice(kvseg_BS, c0, bk, 1), _slice(kvpos_BS, c0, bk, 1)

    def q_step(i, st):
      q0, r0 = _block_slot(ring, me, i, bq), i * bq

      def add(st):
        dq, dkb, dvb = st
        qb, dob = _slice(q_BKGLH, r0, bq, 3), _slice(do_BKGLH, r0, bq, 3)
        s_BKGLS, dlogits_BKGLS = blockwise._logits(  # pylint: disable=protected-access
            spec, qb, kb, _slice(qseg_BL, r0, bq, 1), kvsegb,
            _slice(qpos_BL, r0, bq, 1), kvposb, q0, k0)
        dqb, dkb_new, dvb_new = blockwise.block_grads(
            spec, s_BKGLS, dlogits_BKGLS, _slice(lse_BKGL, r0, bq, 3),
            _slice(delta_BKGL, r0, bq, 3), qb, kb, vb, dob)
        return _update(dq, r0, _slice(dq, r0, bq, 3) + dqb, 3), dkb + dkb_new, dvb + dvb_new

      return jax.lax.cond(_visible(spec, q0, k0), add, lambda st: st, st)

    st = (dq, _slice(dk, c0, bk, 2), _slice(dv, c0, bk, 2))
    dq, dkb, dvb = jax.lax.fori_loop(0, L // bq, q_step, st)
    return dq, _update(dk, c0, dkb, 2), _update(dv, c0, dvb, 2)

  return jax.lax.fori_loop(0, L // bk, kv_block, carry)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ring(spec, ring, q_BKGLH, k_BKSH, v_BKSH, qseg_BL, kvseg_BS, qpos_BL, kvpos_BS):
  return _ring_fwd(spec, ring, q_BKGLH, k_BKSH, v_BKSH, qseg_BL, kvseg_BS, qpos_BL,
                   kvpos_BS)[0]


def _ring_fwd(spec, ring, q_BKGLH, k_BKSH, v_BKSH, qseg_BL, kvseg_BS, qpos_BL, kvpos_BS):
  B, K, G, L, H = q_BKGLH.shape
  q_side = (q_BKGLH, qseg_BL, qpos_BL)

  def step(t, carry):
    kv_side, state = carry
    state = _fold_in_keys(spec, ring, q_side, kv_side, _source(ring, t), state)
    return _pass(ring, kv_side), state

  state = _varying(ring, (jnp.full((B, K, G, L), NEG_INF, F32), jnp.zeros((B, K, G, L), F32),
                          jnp.zeros((B, K, G, L, H), F32)))
  _, (m, l, acc) = jax.lax.fori_loop(0, ring.size, step,
                                     ((k_BKSH, v_BKSH, kvseg_BS, kvpos_BS), state))
  out_BKGLH = (acc / l[..., None]).astype(q_BKGLH.dtype)
  lse_BKGL = m + jnp.log(l)
  return out_BKGLH, (q_BKGLH, k_BKSH, v_BKSH, qseg_BL, kvseg_BS, qpos_BL, kvpos_BS,
                     out_BKGLH, lse_BKGL)


def _ring_bwd(spec, ring, res, do_BKGLH):
  q_BKGLH, k_BKSH, v_BKSH, qseg_BL, kvseg_BS, qpos_BL, kvpos_BS, out_BKGLH, lse_BKGL = res
  delta_BKGL = jnp.einsum("BKGLH,BKGLH->BKGL", do_BKGLH.astype(F32), out_BKGLH.astype(F32))
  q_side = (q_BKGLH, qseg_BL, qpos_BL)

  def step(t, carry):
    kv_side, dq, dkv = carry
    dq, dk, dv = _grads_of_keys(spec, ring, q_side, kv_side, _source(ring, t), lse_BKGL,
                                delta_BKGL, do_BKGLH, (dq, *dkv))
    # dK, dV travel with their keys: after c passes both are back on their own device.
    kv_side, dkv = _pass(ring, (kv_side, (dk, dv)))
    return kv_side, dq, dkv

  zeros = lambda x: _varying(ring, jnp.zeros(x.shape, F32))
  init = ((k_BKSH, v_BKSH, kvseg_BS, kvpos_BS), zeros(q_BKGLH), (zeros(k_BKSH), zeros(v_BKSH)))
  _, dq, (dk, dv) = jax.lax.fori_loop(0, ring.size, step, init)
  return (dq.astype(q_BKGLH.dtype), dk.astype(k_BKSH.dtype), dv.astype(v_BKSH.dtype),
          None, None, None, None)


_ring.defvjp(_ring_fwd, _ring_bwd)


# The auto blocks' float32 score tiles (about four live at once in the backward) stay
# within a quarter of the local queries' bytes (rows x 2C x H x 4): tile rows x b^2 x 4
# <= rows x 2C x H x 4 / TILE_SHARE. Without it a fixed 256 x 256 tile would stay on
# every device whatever the context, and the temporaries would not fall as 1 / context.
TILE_SHARE = 16


def ring_block(spec: AttnSpec, chunk: int, rows: int, head_dim: int) -> tuple[int, int]:
  """(block_q, block_kv): the spec's, else the largest of blockwise.AUTO_BLOCKS within
  both blockwise.auto_block of the `rows` = B * K * G score rows and the tile share of
  the device's 2 * `chunk` queries (the smallest block if none is); cut to divide the
  zig-zag chunk, so a block never straddles two chunks."""
  cap = blockwise.auto_block(rows)
  auto = next((b for b in blockwise.AUTO_BLOCKS
               if b <= cap and TILE_SHARE * b * b <= 2 * chunk * head_dim),
              blockwise.AUTO_BLOCKS[-1])
  return (math.gcd(chunk, spec.block_q or auto), math.gcd(chunk, spec.block_kv or auto))


def ring_attention(q_BLKGH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, data: AttnData,
                   spec: AttnSpec) -> jax.Array:
  """Causal self-attention equal to the reference, split over the "context" mesh axis.

  Under a context axis of c > 1 devices every [B, L, ...] argument (and the output) is in
  the zig-zag token order (`parallel.context.to_zigzag_layout`), in which the Transformer
  runs (model/transformer.py); the masks follow each token's global slot in the natural
  order. A caller holding the natural order moves in and out with `to_zigzag_layout` /
  `from_zigzag_layout`. With c = 1 both orders are the same."""
  check_self_attention("ring", q_BLKGH, k_BSKH, v_BSKH, data)
  B, L, K, G, H = q_BLKGH.shape
  c = context.context_axis_size()
  if L % (2 * c):
    raise ValueError(f"attention_impl='ring' over a context axis of {c} devices cuts the "
                     f"sequence into 2 * {c} chunks: length {L} is not divisible by {2 * c}")
  ring = Ring(size=c, chunk=L // (2 * c))
  bq, bk = ring_block(spec, ring.chunk, B * K * G, H)
  spec = dataclasses.replace(spec, block_q=bq, block_kv=bk)

  def per_shard(q_BLKGH, k_BSKH, v_BSKH, qseg_BL, kvseg_BS, qpos_BL, kvpos_BS):
    out_BKGLH = _ring(spec, ring, q_BLKGH.transpose(0, 2, 3, 1, 4),
                      k_BSKH.transpose(0, 2, 1, 3), v_BSKH.transpose(0, 2, 1, 3),
                      qseg_BL, kvseg_BS, qpos_BL, kvpos_BS)
    return out_BKGLH.transpose(0, 3, 1, 2, 4)

  args = (q_BLKGH, k_BSKH, v_BSKH, data.q_segment_ids_BL, data.kv_segment_ids_BS,
          data.q_positions_BL, data.kv_positions_BS)
  return _sharded_ring(spec, ring, *args) if c > 1 else per_shard(*args)


def _to_local(q_BLKGH, k_BSKH, v_BSKH):
  return (q_BLKGH.transpose(0, 2, 3, 1, 4), k_BSKH.transpose(0, 2, 1, 3),
          v_BSKH.transpose(0, 2, 1, 3))


# Under a context axis the custom_vjp sits outside the two shard_maps (forward, backward),
# which then hold no autodiff: differentiated through, a shard_map stacks its residuals on
# a new leading dimension split over its manual axes, and nested in the pipeline's
# (parallel/pipeline.py) those come out as ("stage", "context"), which Shardy rejects
# ("manual axis 'context' after free axis 'stage'"). Here the residuals stay [B, L, ...].
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _sharded_ring(spec, ring, q_BLKGH, k_BSKH, v_BSKH, qseg_BL, kvseg_BS, qpos_BL, kvpos_BS):
  return _sharded_ring_fwd(spec, ring, q_BLKGH, k_BSKH, v_BSKH, qseg_BL, kvseg_BS, qpos_BL,
                           kvpos_BS)[0]


def _sharded_ring_fwd(spec, ring, *args):
  def local(q_BLKGH, k_BSKH, v_BSKH, *masks):
    out_BKGLH, res = _ring_fwd(spec, ring, *_to_local(q_BLKGH, k_BSKH, v_BSKH), *masks)
    return out_BKGLH.transpose(0, 3, 1, 2, 4), res[-1].transpose(0, 3, 1, 2)

  out_BLKGH, lse_BLKG = context.varying(context.shard_over_context(local, *args,
                                                                   check_vma=False), None)
  return out_BLKGH, (args, out_BLKGH, lse_BLKG)


def _sharded_ring_bwd(spec, ring, res, do_BLKGH):
  args, out_BLKGH, lse_BLKG = res

  def local(q_BLKGH, k_BSKH, v_BSKH, qseg_BL, kvseg_BS, qpos_BL, kvpos_BS, out_BLKGH,
            lse_BLKG, do_BLKGH):
    local_res = (*_to_local(q_BLKGH, k_BSKH, v_BSKH), qseg_BL, kvseg_BS, qpos_BL, kvpos_BS,
                 out_BLKGH.transpose(0, 2, 3, 1, 4), lse_BLKG.transpose(0, 2, 3, 1))
    dq_BKGLH, dk_BKSH, dv_BKSH, *_ = _ring_bwd(spec, ring, local_res,
                                               do_BLKGH.transpose(0, 2, 3, 1, 4))
    return (dq_BKGLH.transpose(0, 3, 1, 2, 4), dk_BKSH.transpose(0, 2, 1, 3),
            dv_BKSH.transpose(0, 2, 1, 3))

  grads = context.shard_over_context(local, *args, out_BLKGH, lse_BLKG, do_BLKGH,
                                     check_vma=False)
  return (*context.varying(grads, None), None, None, None, None)


_sharded_ring.defvjp(_sharded_ring_fwd, _sharded_ring_bwd)

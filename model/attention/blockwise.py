"""Blockwise (flash) attention in pure JAX: memory linear in sequence length, any backend.

Queries go in blocks of `block_q`, keys and values in blocks of `block_kv`. Each
query block runs an online softmax (running max m and sum l) over only the key
blocks its mask can reach: blocks above the causal diagonal, and with a sliding
window those wholly left of it, are never visited (the loop bounds depend on the
block index, model/attention/scores.py's visible_kv_slots). Each block pair's soft-cap,
biases and mask come from the score hook (scores.logits), computed per block.

The backward pass is a `jax.custom_vjp` in the manner of FlashAttention-2: the
forward keeps q, k, v, the output and each row's logsumexp, and the backward
recomputes every visited block's probabilities from them, so neither pass holds
an [L, S] array. It loops over key blocks (the block's dK, dV accumulate in
block-sized buffers) and, inside, over the query blocks that can see that
block, adding into a float32 dQ buffer in place: the logits of a block pair are
recomputed once, not once for dQ and again for dK, dV as in a split backward.

Both passes work head-major: q, k, v (and dO) are transposed once to [B, K, G, L, H]
/ [B, K, S, H], so each block is a contiguous slice and every block product is a
batched matmul over (B, K) with no per-block transpose (faster on CPU than slicing
[B, L, K, G, H]; docs/PERFORMANCE.md, "Third round"). `block_q` / `block_kv` = 0 (the
default) sizes blocks from the score rows: `auto_block`.

A `b` before the shape suffix (qb_BKGLH) names one block: there L and S are block
lengths. Sequences not divisible by a block are padded: padded keys get a segment
id no query has and padded queries one no key has, so they change nothing (a
padded row's output is finite and dropped; its zero cotangent gives zero gradient).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from model.attention import scores
from model.attention.reference import NEG_INF, AttnData, AttnSpec, check_self_attention
from parallel.context import varying  # Loop carries typed as the data (inside a stage).

PAD_Q_SEGMENT, PAD_KV_SEGMENT = -2, -1  # Real ids are >= 0 (0 = padding documents).
F32 = jnp.float32
AUTO_BLOCKS = (256, 128, 64)  # auto_block's candidates, largest first.
AUTO_TILE_BYTES = 4 * 2**20


def _round_up(n: int, block: int) -> int:
  return -(-n // block) * block


def _slice(x: jax.Array, start, size: int, axis: int = 1) -> jax.Array:
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _logits(spec: AttnSpec, q_BKGLH, k_BKSH, qseg_BL, kvseg_BS, qpos_BL, kvpos_BS, q0, k0):
  """Masked float32 logits of one block pair through the score hook (scores.logits).

  Returns (logits_BKGLS, dlogits_BKGLS): d logits / d scores (None without a soft-cap)
  is what the backward pass multiplies the score gradient by.
  """
  L, S = q_BKGLH.shape[3], k_BKSH.shape[2]
  s_BKGLS = jnp.einsum("BKGLH,BKSH->BKGLS", q_BKGLH, k_BKSH,
                       preferred_element_type=F32) * spec.scale
  tile = scores.Tile(q0 + jnp.arange(L), k0 + jnp.arange(S), qseg_BL, kvseg_BS, qpos_BL,
                     kvpos_BS)
  return scores.logits(spec, s_BKGLS, tile)


def online_softmax_step(state, s_BKGLS, vb_BKSH):
  """One key block's masked logits into a query block's running (max m, sum l, weighted
  values acc): the online softmax. Returns the updated (m_BKGL, l_BKGL, acc_BKGLH)."""
  m_BKGL, l_BKGL, acc_BKGLH = state
  m_new_BKGL = jnp.maximum(m_BKGL, s_BKGLS.max(-1))
  # A row masked so far has m = NEG_INF: its p = 1 junk is scaled away by
  # exp(NEG_INF - m_real) = 0 once a visible key arrives (every real row has one).
  corr_BKGL = jnp.exp(m_BKGL - m_new_BKGL)
  p_BKGLS = jnp.exp(s_BKGLS - m_new_BKGL[..., None])
  pv_BKGLH = jnp.einsum("BKGLS,BKSH->BKGLH", p_BKGLS.astype(vb_BKSH.dtype), vb_BKSH,
                        preferred_element_type=F32)
  return (m_new_BKGL, l_BKGL * corr_BKGL + p_BKGLS.sum(-1),
          acc_BKGLH * corr_BKGL[..., None] + pv_BKGLH)


def block_grads(spec: AttnSpec, s_BKGLS, dlogits_BKGLS, lseb_BKGL, deltab_BKGL, qb_BKGLH,
                kb_BKSH, vb_BKSH, dob_BKGLH):
  """float32 (dq, dk, dv) of one block pair from its recomputed logits (and d logits /
  d scores, None without a soft-cap: `_logits`), the rows' final logsumexp and
  D = rowsum(dO * O): the FlashAttention-2 backward of one block."""
  p_BKGLS = jnp.exp(s_BKGLS - lseb_BKGL[..., None])
  dvb_BKSH = jnp.einsum("BKGLS,BKGLH->BKSH", p_BKGLS.astype(dob_BKGLH.dtype), dob_BKGLH,
                        preferred_element_type=F32)
  dp_BKGLS = jnp.einsum("BKGLH,BKSH->BKGLS", dob_BKGLH, vb_BKSH, preferred_element_type=F32)
  ds_BKGLS = p_BKGLS * (dp_BKGLS - deltab_BKGL[..., None])
  if dlogits_BKGLS is not None:
    ds_BKGLS = ds_BKGLS * dlogits_BKGLS
  ds_BKGLS = (ds_BKGLS * spec.scale).astype(qb_BKGLH.dtype)
  dqb_BKGLH = jnp.einsum("BKGLS,BKSH->BKGLH", ds_BKGLS, kb_BKSH, preferred_element_type=F32)
  dkb_BKSH = jnp.einsum("BKGLS,BKGLH->BKSH", ds_BKGLS, qb_BKGLH, preferred_element_type=F32)
  return dqb_BKGLH, dkb_BKSH, dvb_BKSH


def _kv_blocks(spec: AttnSpec, i, num_kv_blocks: int):
  """[lo, hi) of the key blocks query block i can see."""
  bq, bk = spec.block_q, spec.block_kv
  first, last = scores.visible_kv_slots(spec, i * bq, (i + 1) * bq - 1)
  return first // bk, jnp.minimum(last // bk + 1, num_kv_blocks)


def _q_blocks(spec: AttnSpec, j, num_q_blocks: int):
  """[lo, hi) of the query blocks that can see key block j."""
  bq, bk = spec.block_q, spec.block_kv
  first, last = scores.visible_q_slots(spec, j * bk, (j + 1) * bk - 1)
  hi = num_q_blocks if last is None else jnp.minimum(last // bq + 1, num_q_blocks)
  return first // bq, hi


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(spec, q_BLKGH, k_BSKH, v_BSKH, qseg_BL, kvseg_BS, qpos_BL, kvpos_BS):
  """(out_BLKGH, the largest unmasked logit): the max is the rows' running max m, free; it
  has no gradient (telemetry), and XLA drops it where nothing reads it."""
  out_BLKGH, _, max_logit = _forward(spec, q_BLKGH, k_BSKH, v_BSKH, qseg_BL, kvseg_BS,
                                     qpos_BL, kvpos_BS)
  return out_BLKGH, max_logit


def _forward(spec, q_BLKGH, k_BSKH, v_BSKH, qseg_BL, kvseg_BS, qpos_BL, kvpos_BS):
  """(out_BLKGH, lse_BKGL, max logit) on padded inputs."""
  B, L, K, G, H = q_BLKGH.shape
  bq, bk = spec.block_q, spec.block_kv
  q_BKGLH = q_BLKGH.transpose(0, 2, 3, 1, 4)
  k_BKSH, v_BKSH = k_BSKH.transpose(0, 2, 1, 3), v_BSKH.transpose(0, 2, 1, 3)

  def q_block(i, carry):
    out_BKGLH, lse_BKGL, max_logit = carry
    q0 = i * bq
    qb_BKGLH = _slice(q_BKGLH, q0, bq, axis=3)
    qsegb_BL, qposb_BL = (_slice(x, q0, bq) for x in (qseg_BL, qpos_BL))

    def kv_step(j, state):
      k0 = j * bk
      kb_BKSH, vb_BKSH = (_slice(x, k0, bk, axis=2) for x in (k_BKSH, v_BKSH))
      kvsegb_BS, kvposb_BS = (_slice(x, k0, bk) for x in (kvseg_BS, kvpos_BS))
      s_BKGLS, _ = _logits(spec, qb_BKGLH, kb_BKSH, qsegb_BL, kvsegb_BS, qposb_BL, kvposb_BS,
                           q0, k0)
      return online_softmax_step(state, s_BKGLS, vb_BKSH)

    init = varying((jnp.full((B, K, G, bq), NEG_INF, F32), jnp.zeros((B, K, G, bq), F32),
                    jnp.zeros((B, K, G, bq, H), F32)), axis=None)
    m_BKGL, l_BKGL, acc_BKGLH = jax.lax.fori_loop(*_kv_blocks(spec, i, k_BSKH.shape[1] // bk),
                                                  kv_step, init)
    ob_BKGLH = acc_BKGLH / l_BKGL[..., None]
    out_BKGLH = jax.lax.dynamic_update_slice_in_dim(out_BKGLH, ob_BKGLH.astype(out_BKGLH.dtype),
                                                    q0, axis=3)
    lse_BKGL = jax.lax.dynamic_update_slice_in_dim(lse_BKGL, m_BKGL + jnp.log(l_BKGL), q0, axis=3)
    # A row with no visible key (a padded query) keeps m = NEG_INF: no real row is below.
    return out_BKGLH, lse_BKGL, jnp.maximum(max_logit, m_BKGL.max())

  init = varying((jnp.zeros_like(q_BKGLH), jnp.zeros((B, K, G, L), F32),
                  jnp.full((), -jnp.inf, F32)), axis=None)
  out_BKGLH, lse_BKGL, max_logit = jax.lax.fori_loop(0, L // bq, q_block, init)
  return out_BKGLH.transpose(0, 3, 1, 2, 4), lse_BKGL, max_logit


def _flash_fwd(spec, q_BLKGH, k_BSKH, v_BSKH, qseg_BL, kvseg_BS, qpos_BL, kvpos_BS):
  out_BLKGH, lse_BKGL, max_logit = _forward(spec, q_BLKGH, k_BSKH, v_BSKH, qseg_BL, kvseg_BS,
                                            qpos_BL, kvpos_BS)
  return (out_BLKGH, max_logit), (q_BLKGH, k_BSKH, v_BSKH, qseg_BL, kvseg_BS, qpos_BL, kvpos_BS,
                     out_BLKGH, lse_BKGL)


def _flash_bwd(spec, res, cotangents):
  dout_BLKGH, _ = cotangents  # The max logit has no gradient.
  q_BLKGH, k_BSKH, v_BSKH, qseg_BL, kvseg_BS, qpos_BL, kvpos_BS, out_BLKGH, lse_BKGL = res
  B, L, K, G, H = q_BLKGH.shape
  S = k_BSKH.shape[1]
  bq, bk = spec.block_q, spec.block_kv
  # D = rowsum(dO * O): the softmax backward's row term, once for all blocks.
  delta_BKGL = jnp.einsum("BLKGH,BLKGH->BKGL", dout_BLKGH.astype(F32), out_BLKGH.astype(F32))
  q_BKGLH, do_BKGLH = (x.transpose(0, 2, 3, 1, 4) for x in (q_BLKGH, dout_BLKGH))
  k_BKSH, v_BKSH = k_BSKH.transpose(0, 2, 1, 3), v_BSKH.transpose(0, 2, 1, 3)

  def kv_block(j, carry):
    dq_BKGLH, dk_BKSH, dv_BKSH = carry
    k0 = j * bk
    kb_BKSH, vb_BKSH = (_slice(x, k0, bk, axis=2) for x in (k_BKSH, v_BKSH))
    kvsegb_BS, kvposb_BS = (_slice(x, k0, bk) for x in (kvseg_BS, kvpos_BS))

    def q_step(i, state):
      dq_BKGLH, dkb_BKSH, dvb_BKSH = state
      q0 = i * bq
      qb_BKGLH, dob_BKGLH, lseb_BKGL, deltab_BKGL = (
          _slice(x, q0, bq, axis=3) for x in (q_BKGLH, do_BKGLH, lse_BKGL, delta_BKGL))
      qsegb_BL, qposb_BL = (_slice(x, q0, bq) for x in (qseg_BL, qpos_BL))
      s_BKGLS, dlogits_BKGLS = _logits(spec, qb_BKGLH, kb_BKSH, qsegb_BL, kvsegb_BS, qposb_BL,
                                       kvposb_BS, q0, k0)
      dqb_BKGLH, dkb, dvb = block_grads(spec, s_BKGLS, dlogits_BKGLS, lseb_BKGL, deltab_BKGL,
                                        qb_BKGLH, kb_BKSH, vb_BKSH, dob_BKGLH)
      dq_BKGLH = jax.lax.dynamic_update_slice_in_dim(
          dq_BKGLH, _slice(dq_BKGLH, q0, bq, axis=3) + dqb_BKGLH, q0, axis=3)
      return dq_BKGLH, dkb_BKSH + dkb, dvb_BKSH + dvb

    init = varying((dq_BKGLH, jnp.zeros((B, K, bk, H), F32), jnp.zeros((B, K, bk, H), F32)),
                   axis=None)
    dq_BKGLH, dkb_BKSH, dvb_BKSH = jax.lax.fori_loop(*_q_blocks(spec, j, L // bq), q_step, init)
    dk_BKSH = jax.lax.dynamic_update_slice_in_dim(dk_BKSH, dkb_BKSH, k0, axis=2)
    dv_BKSH = jax.lax.dynamic_update_slice_in_dim(dv_BKSH, dvb_BKSH, k0, axis=2)
    return dq_BKGLH, dk_BKSH, dv_BKSH

  init = varying((jnp.zeros(q_BKGLH.shape, F32), jnp.zeros(k_BKSH.shape, F32),
                  jnp.zeros(v_BKSH.shape, F32)), axis=None)
  dq_BKGLH, dk_BKSH, dv_BKSH = jax.lax.fori_loop(0, S // bk, kv_block, init)
  return (dq_BKGLH.transpose(0, 3, 1, 2, 4).astype(q_BLKGH.dtype),
          dk_BKSH.transpose(0, 2, 1, 3).astype(k_BSKH.dtype),
          dv_BKSH.transpose(0, 2, 1, 3).astype(v_BSKH.dtype), None, None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def auto_block(rows: int) -> int:
  """The block length of `block_q` / `block_kv` = 0 for `rows` = B * K * G score rows.

  The largest of 256, 128, 64 whose float32 [B, K, G, block, block] score tile fits in
  AUTO_TILE_BYTES, else 64. On 2 CPU cores (docs/PERFORMANCE.md, "Third round"; the
  attention benchmark's block sweep re-measures it) 256 is fastest while its tile stays
  within 4 MiB and loses once the tile outgrows the cache, where 128 is faster. Not
  optimal at 4 rows, where 64-blocks ran some lengths faster. The rows are those of the
  arrays attention is given: under a mesh, the global batch and heads.
  """
  return next((b for b in AUTO_BLOCKS if rows * b * b * 4 <= AUTO_TILE_BYTES), AUTO_BLOCKS[-1])


def blockwise_attention(q_BLKGH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array,
                        data: AttnData, spec: AttnSpec, return_max: bool = False):
  """Causal self-attention equal to the reference, in blocks; out_BLKGH (return_max:
  (out_BLKGH, the largest unmasked logit), as the reference's)."""
  check_self_attention("blockwise", q_BLKGH, k_BSKH, v_BSKH, data)
  B, L, K, G, _ = q_BLKGH.shape
  auto = auto_block(B * K * G)
  # A sequence shorter than a block is one block, not a padded one.
  bq, bk = min(spec.block_q or auto, L), min(spec.block_kv or auto, L)
  spec = dataclasses.replace(spec, block_q=bq, block_kv=bk)
  Lp, Sp = _round_up(L, bq), _round_up(L, bk)

  def pad(x, n, value=0):
    widths = [(0, 0), (0, n - x.shape[1])] + [(0, 0)] * (x.ndim - 2)
    return jnp.pad(x, widths, constant_values=value)

  out_BLKGH, max_logit = _flash(spec, pad(q_BLKGH, Lp), pad(k_BSKH, Sp), pad(v_BSKH, Sp),
                                pad(data.q_segment_ids_BL, Lp, PAD_Q_SEGMENT),
                                pad(data.kv_segment_ids_BS, Sp, PAD_KV_SEGMENT),
                                pad(data.q_positions_BL, Lp), pad(data.kv_positions_BS, Sp))
  return (out_BLKGH[:, :L], jax.lax.stop_gradient(max_logit)) if return_max else out_BLKGH[:, :L]


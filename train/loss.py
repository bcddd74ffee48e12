"""The vocabulary-tiled output head + cross-entropy: no [B, L, V] array in a step.

The model returns its final-normed hidden_BLD (`Transformer(..., return_hidden=True)`);
`token_losses` applies the model's own head (`Embedder.decode`: the tied table or the
untied lm_head, with µP's readout multiplier) to one chunk of tokens at a time inside a
`lax.scan`, in float32, and keeps per token only what the step needs: the cross-entropy,
log Z (an output z-loss's input), whether the argmax is the target, and the max / mean
logit (stability telemetry without a second pass). The scan body is `jax.checkpoint`ed,
so the backward pass recomputes each chunk's [B, L / n, V] logits instead of saving
them; the head's gradient accumulates over the chunks in the scan's transpose (what
MaxText's `num_vocab_tiling` does with a custom VJP).

Chunks are strided along each sequence (chunk c holds positions c, c + n, c + 2n, ...),
so every chunk keeps the batch (and context) sharding of the hidden states and the
logits stay split over the vocabulary ("vocab" -> "tensor", parallel/rules.py). Each
token's loss is computed alone, so the chunking changes no number (a resume may change
it: train/lifecycle/changes.py). A length that n does not divide is padded at the end;
the padded tokens are dropped.
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from model import ModelConfig
from model.layers import Embedder
from model.quantization import quantized

# "auto": chunks of about this many bytes of float32 logits per device (MaxText's
# vocab tiling sizes its tiles the same way: a few hundred MiB beside a 16-95 GiB chip).
AUTO_CHUNK_BYTES = 256 * 2**20
_BATCH_AXES = ("data", "fsdp", "expert", "context")  # "batch" and "length" (parallel/rules.py)


class TokenLosses(NamedTuple):
  """Per-token figures of the output head, float32 [B, L] (correct: 0/1)."""
  ce_BL: jax.Array  # log Z - logit[target]
  logz_BL: jax.Array  # logsumexp over the vocabulary
  correct_BL: jax.Array  # argmax == target
  max_logit_BL: jax.Array
  mean_logit_BL: jax.Array


def _mesh_sizes() -> dict[str, int]:
  mesh = jax.sharding.get_abstract_mesh()
  return {} if mesh.empty else {k: int(v) for k, v in mesh.shape.items()}


def auto_chunks(vocab_size: int, tokens: int, sizes: dict[str, int] | None = None) -> int:
  """Chunks for ~AUTO_CHUNK_BYTES of float32 logits per device: `tokens` (B * L, global)
  split over the batch / context axes, the vocabulary over "tensor" (`sizes`: the mesh's
  axis sizes; None: the current mesh's)."""
  sizes = _mesh_sizes() if sizes is None else sizes
  per_device = tokens / math.prod(sizes.get(a, 1) for a in _BATCH_AXES)
  vocab = vocab_size / sizes.get("tensor", 1)
  return max(1, math.ceil(per_device * vocab * 4 / AUTO_CHUNK_BYTES))


def resolve_chunks(model_cfg: ModelConfig, B: int, L: int,
                   sizes: dict[str, int] | None = None) -> int:
  """The chunk count `token_losses` uses for a [B, L] batch: model.loss_chunks ("auto":
  `auto_chunks`), at most L."""
  n = model_cfg.loss_chunks
  if n == "auto":
    n = auto_chunks(model_cfg.vocab_size, B * L, sizes)
  return max(1, min(int(n), L))


def head_logits(model_cfg: ModelConfig, params, hidden_BLD: jax.Array) -> jax.Array:
  """The model's own output head (Embedder.decode) on hidden states: float32 logits."""
  head = quantized(Embedder(model_cfg), model_cfg, ("decode",))  # quantize_head's rule.
  return head.apply({"params": params["embedder"]}, hidden_BLD, method="decode")


def _gathered_head(params) -> dict:
  """The head's parameters whole along D (split over the vocabulary only): under FSDP
  gathered once for all chunks, not once per chunk inside the scan."""
  emb = dict(params["embedder"])
  emb["embedding"] = nn.with_logical_constraint(emb["embedding"], ("vocab", None))
  if "unembed" in emb:
    emb["unembed"] = {"w": nn.with_logical_constraint(emb["unembed"]["w"], (None, "vocab"))}
  return {"embedder": emb}


def _target_logits(logits_BLV: jax.Array, t_BL: jax.Array) -> jax.Array:
  """The target's logit per token: a gather, or inside a manual "stage" region (a 1F1B
  schedule's loss) a one-hot select and sum (MaxText's one-hot cross-entropy), the same
  value: there XLA's SPMD partitioner aborts on the gather of vocabulary-split logits with
  a batch axis and tensor (docs/scaling.md, "The 1F1B schedule"). Not everywhere: on
  XLA:CPU the select made a head's forward and backward 42% slower than the gather (149
  against 105 ms: [16, 128] tokens, d 128, an 8k vocabulary, the median of 15)."""
  if "stage" not in jax.sharding.get_abstract_mesh().manual_axes:
    return jnp.take_along_axis(logits_BLV, t_BL[..., None], axis=-1)[..., 0]
  vocab_BLV = jax.lax.broadcasted_iota(t_BL.dtype, logits_BLV.shape, logits_BLV.ndim - 1)
  return jnp.sum(jnp.where(t_BL[..., None] == vocab_BLV, logits_BLV, 0.0), axis=-1)


def _chunk_losses(model_cfg: ModelConfig, params, h_BLD, t_BL) -> TokenLosses:
  logits_BLV = head_logits(model_cfg, params, h_BLD)
  logits_BLV = nn.with_logical_constraint(logits_BLV, ("batch", "length", "vocab"))
  logz_BL = jax.nn.logsumexp(logits_BLV, axis=-1)
  target_BL = _target_logits(logits_BLV, t_BL)
  return TokenLosses(
      ce_BL=logz_BL - target_BL, logz_BL=logz_BL,
      correct_BL=(jnp.argmax(logits_BLV, axis=-1) == t_BL).astype(jnp.float32),
      max_logit_BL=jax.lax.stop_gradient(jnp.max(logits_BLV, axis=-1)),
      mean_logit_BL=jax.lax.stop_gradient(jnp.mean(logits_BLV, axis=-1)))


_PROBE: list = []  # [scale, counts seen] while `chunk_probe` is active.


@contextlib.contextmanager
def chunk_probe(scale: int = 1):
  """Steps traced inside run the chunk scan over `scale` x the chunks they would (at
  most L; a one-chunk loss is left alone) and record in the yielded list the count they
  would have used. XLA's cost analysis counts a loop body once: the roofline's probes
  (train/aot/compile.py probe_train_cost) compile a step at 1x and 2x the chunks and
  recover the n chunks' cost from the difference, with the scan kept rolled (unrolled,
  XLA computed every chunk's [V, D] head gradient at once: out of memory at the 1b
  preset's 63 chunks)."""
  seen: list[int] = []
  _PROBE[:] = [scale, seen]
  try:
    yield seen
  finally:
    _PROBE.clear()


def token_losses(model_cfg: ModelConfig, params, hidden_BLD: jax.Array,
                 targets_BL: jax.Array, chunks: int | str | None = None) -> TokenLosses:
  """Per-token losses of the head over hidden_BLD, `chunks` token chunks at a time
  (None: model_cfg.loss_chunks; "auto" as there). `params`: the model's params."""
  B, L, D = hidden_BLD.shape
  chex.assert_shape(targets_BL, (B, L))
  cfg = model_cfg if chunks is None else model_cfg.replace(loss_chunks=chunks)
  n = resolve_chunks(cfg, B, L)
  if _PROBE and n > 1:
    _PROBE[1].append(n)
    n = min(n * _PROBE[0], L)
  params = _gathered_head(params)
  if n == 1:  # One chunk: nothing to scan over (and nothing for a scan to save).
    return _chunk_losses(model_cfg, params, hidden_BLD, targets_BL)
  Lc = -(-L // n)
  pad = Lc * n - L
  if pad:
    hidden_BLD = jnp.pad(hidden_BLD, ((0, 0), (0, pad), (0, 0)))
    targets_BL = jnp.pad(targets_BL, ((0, 0), (0, pad)))
  # [B, Lc * n] -> [n, B, Lc]: chunk c holds positions c, c + n, ... of every sequence.
  h_nBLD = jnp.moveaxis(hidden_BLD.reshape(B, Lc, n, D), 2, 0)
  t_nBL = jnp.moveaxis(targets_BL.reshape(B, Lc, n), 2, 0)

  @jax.checkpoint  # The backward recomputes the chunk's logits instead of saving them.
  def body(carry, xs):
    h_BLD, t_BL = xs
    h_BLD = nn.with_logical_constraint(h_BLD, ("batch", "length", "embed"))
    return carry, _chunk_losses(model_cfg, params, h_BLD, t_BL)

  _, out = jax.lax.scan(body, None, (h_nBLD, t_nBL))
  return TokenLosses(*(jnp.moveaxis(x, 0, 2).reshape(B, Lc * n)[:, :L] for x in out))

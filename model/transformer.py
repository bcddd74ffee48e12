"""The layer stack and the Transformer (the layers: model/block.py; a segment as a
pipeline over stages: model/pipelined.py).

The stack is a list of segments (the first `first_k_dense` dense layers, then
the rest); each segment is one `nn.scan` (one compile for any depth) or, with
`scan_layers=False`, a Python loop with the same numbers (`scan_unroll` unrolls the
scanned loop, keeping its stacked parameters). Layers differ within
a segment only by their kind (ModelConfig.layer_kind: window, RoPE or NoPE),
which repeats with `cfg.layer_period` M: the scanned body is one period, M
blocks of static kinds (`Period`, each `block_{j}`), scanned over n / M repeats.
With M = 1 (no patterns) the body is one Block: the parameter tree is the one
without patterns. Unscanned, layer i is `layer_{i}` either way; `unstack_layers`
and `stack_layers` convert between the two layouts.
"""

from __future__ import annotations

from typing import Callable

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from model import positional
from model.block import block_class, residual_names, scanned
from model.config import ModelConfig
from model.layers import Embedder, embedding_std, make_norm
from model.pipelined import pipelined_loss, pipelined_stack
from parallel.context import context_axis_size, from_zigzag_layout, to_zigzag_layout
from parallel.pipeline import stage_axis_size

def layer_segments(cfg: ModelConfig) -> list[tuple[str, int, int, bool]]:
  """(name, first layer, number of layers, is_moe) for each segment.

  Each holds whole periods of the layer patterns (ModelConfig validates first_k_dense).
  """
  k = cfg.first_k_dense if cfg.num_experts else cfg.num_layers
  segments = []
  if k:
    segments.append(("layers" if k == cfg.num_layers else "dense_layers", 0, k, False))
  if k < cfg.num_layers:
    segments.append(("layers" if k == 0 else "moe_layers", k, cfg.num_layers - k, True))
  return segments


def _scanned_slots(cfg: ModelConfig):
  """(layer, segment name, block name or None, repeat) of every layer in the scanned tree."""
  M = cfg.layer_period
  for name, first, n, _ in layer_segments(cfg):
    for i in range(first, first + n):
      yield i, name, (f"block_{(i - first) % M}" if M > 1 else None), (i - first) // M


def unstack_layers(cfg: ModelConfig, tree: dict) -> dict:
  """One collection of Transformer(cfg) (scanned) -> the unscanned layout (`layer_{i}`).

  Layers absent from the collection (e.g. dense ones in `moe_state`) stay absent.
  """
  tree = dict(tree)
  stacked = {name: tree.pop(name) for name, *_ in layer_segments(cfg) if name in tree}
  for i, name, block, r in _scanned_slots(cfg):
    if name in stacked:
      sub = stacked[name][block] if block else stacked[name]
      tree[f"layer_{i}"] = jax.tree.map(lambda x, r=r: x[r], sub)
  return tree


def stack_layers(cfg: ModelConfig, tree: dict) -> dict:
  """The inverse of `unstack_layers`: `layer_{i}` entries -> the scanned layout."""
  tree = dict(tree)
  groups: dict = {}
  for i, name, block, _ in _scanned_slots(cfg):  # Repeats in order within each group.
    if f"layer_{i}" in tree:
      groups.setdefault((name, block), []).append(tree.pop(f"layer_{i}"))
  for (name, block), layers in groups.items():
    # NumPy trees (interop/) stay NumPy; anything else (traced, device arrays) is jnp.
    stacked = jax.tree.map(
        lambda *xs: (np if isinstance(xs[0], np.ndarray) else jnp).stack(xs), *layers)
    if block:
      tree.setdefault(name, {})[block] = stacked
    else:
      tree[name] = stacked
  return tree


def abstract_variables(cfg: ModelConfig, *, unbox: bool = True) -> dict:
  """Transformer(cfg).init's variables ({"params", maybe "moe_state"}) as a tree of
  ShapeDtypeStructs, computing nothing; unbox=False keeps the logical-axis boxes
  (nn.LogicallyPartitioned) around the leaves. No variable's shape depends on the
  input length, so a [1, 1] input stands for any."""
  init = lambda: Transformer(cfg).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
  shapes = jax.eval_shape(init)
  return nn.unbox(shapes) if unbox else shapes


def _sinusoidal(cfg: ModelConfig, positions_BL: jax.Array) -> jax.Array:
  # As the original Transformer's: token entries of unit variance beside
  # sinusoids of RMS 1/sqrt(2); with a tied (1/sqrt(D)) table, both scaled alike.
  return embedding_std(cfg) * positional.sinusoidal_embedding(positions_BL, cfg.d_model)


def _learned(cfg: ModelConfig, positions_BL: jax.Array) -> jax.Array:
  # Created inside Transformer.__call__ (compact), so its params are "pos_embedding".
  return positional.LearnedPositionalEmbedding(
      cfg.max_seq_len, cfg.d_model, embedding_std(cfg), name="pos_embedding")(positions_BL)


# The pos_encoding kinds added to the token embedding, on its scale
# (layers.embedding_std): kind -> (cfg, positions_BL) -> pe_BLD. The other kinds act
# inside attention (rope, alibi) or not at all (none).
ADDITIVE_POSITIONS: dict[str, Callable[[ModelConfig, jax.Array], jax.Array]] = {
    "sinusoidal": _sinusoidal, "learned": _learned}


class Transformer(nn.Module):
  """Decoder-only Transformer: tokens_BL -> logits_BLV (float32)."""

  cfg: ModelConfig

  def _variables(self, segment: str | None = None) -> dict:
    """The params and router biases (all, or one segment's) a pipeline runs on."""
    return {c: v if segment is None else {segment: v[segment]}
            for c, v in ((c, self.variables.get(c, {})) for c in ("params", "moe_state"))
            if v and (segment is None or segment in v)}

  def _put_aux(self, segment: str, aux: dict) -> None:
    """A pipelined segment's aux, where the unpipelined stack would have sown it."""
    if aux and self.is_mutable_collection("aux"):
      self.put_variable("aux", segment, aux[segment])

  @nn.compact
  def __call__(self, tokens_BL: jax.Array, positions_BL: jax.Array | None = None,
               segment_ids_BL: jax.Array | None = None, *, deterministic: bool = True,
               decode: bool = False, return_hidden: bool = False,
               pipeline_microbatches: int = 0, pipeline_repeats: int = 1,
               pipeline_loss=None) -> jax.Array:
    """logits_BLV; with return_hidden, the final-normed hidden_BLD instead, which
    `Embedder.decode` (the head) turns into those logits: train/loss.py applies the head
    chunk by chunk so the [B, L, V] logits never exist. pipeline_microbatches: under a
    mesh with a stage axis, the pipeline's microbatches (0: one per stage).
    pipeline_repeats: R > 1 runs the circular schedule, and then the scanned stack's
    params' rows must be in its pipeline order (parallel/pipeline_circular.py; a train
    state holds them so while it trains, train/state.py PipelineOrder), the router biases
    (`moe_state`) in layer order; 1: GPipe, rows in layer order. pipeline_loss: under a
    stage axis, run the 1F1B schedule, which owns the loss, and return its (loss, stats_M)
    instead, its aux sown as the stack's (`pipelined_loss`; train/step.py; None: GPipe)."""
    cfg = self.cfg
    chex.assert_rank(tokens_BL, 2)
    B, L = tokens_BL.shape
    if positions_BL is None:
      positions_BL = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    if segment_ids_BL is None:
      segment_ids_BL = jnp.ones((B, L), jnp.int32)
    chex.assert_shape([positions_BL, segment_ids_BL], (B, L))
    if cfg.pos_encoding == "learned" and L > cfg.max_seq_len:
      raise ValueError(f"sequence length {L} exceeds ModelConfig.max_seq_len="
                       f"{cfg.max_seq_len}, the size of the learned position table")

    # Under a context axis the stack runs in the zig-zag token order (parallel/context.py):
    # set here once, undone on the output, so no layer moves its activations (what layers
    # sow, e.g. "intermediates", is in that order).
    zigzag = context_axis_size() > 1 and not decode and not self.is_initializing()
    if zigzag:
      tokens_BL, positions_BL, segment_ids_BL = to_zigzag_layout(
          (tokens_BL, positions_BL, segment_ids_BL))

    embedder = Embedder(cfg, name="embedder")
    x_BLD = embedder.encode(tokens_BL)
    if cfg.pos_encoding in ADDITIVE_POSITIONS:
      pe_BLD = ADDITIVE_POSITIONS[cfg.pos_encoding](cfg, positions_BL)
      x_BLD = x_BLD + pe_BLD.astype(x_BLD.dtype)
    self.sow("intermediates", "embedded_BLD", x_BLD)  # Tokens + positions (for tests).
    x_BLD = nn.Dropout(cfg.embed_dropout_rate)(x_BLD, deterministic=deterministic)
    x_BLD = nn.with_logical_constraint(x_BLD, residual_names(cfg))

    block_cls, M = block_class(cfg), cfg.layer_period
    # Under a stage axis each scanned segment is a pipeline (parallel/pipeline*.py).
    stages = stage_axis_size() if not decode and not self.is_initializing() else 1
    for name, first, n, is_moe in layer_segments(cfg):
      kinds = tuple(cfg.layer_kind(i) for i in range(first, first + M))
      key = None if deterministic or stages == 1 else self.make_rng("dropout")
      if stages > 1 and pipeline_loss is not None:  # 1F1B: the loss inside (one segment).
        loss, stats_M, aux = pipelined_loss(
            cfg, name, is_moe, kinds, self._variables(), x_BLD, positions_BL, segment_ids_BL,
            key, pipeline_microbatches, pipeline_loss)
        self._put_aux(name, aux)
        return loss, stats_M
      if stages > 1:
        x_BLD, aux = pipelined_stack(cfg, name, is_moe, kinds, self._variables(name), x_BLD,
                                     positions_BL, segment_ids_BL, key,
                                     pipeline_microbatches, pipeline_repeats)
        self._put_aux(name, aux)
      elif cfg.scan_layers:
        stack, args = scanned(cfg, is_moe, kinds, n)
        x_BLD, _ = stack(cfg, *args, name=name)(x_BLD, positions_BL, segment_ids_BL,
                                                deterministic, decode)
      else:
        for i in range(first, first + n):
          x_BLD, _ = block_cls(cfg, is_moe, cfg.layer_kind(i), name=f"layer_{i}")(
              x_BLD, positions_BL, segment_ids_BL, deterministic, decode)

    if cfg.norm_position == "pre":
      x_BLD = make_norm(cfg, "final_norm")(x_BLD)
    if return_hidden:
      x_BLD = nn.with_logical_constraint(x_BLD, ("batch", "length", "embed"))
      chex.assert_shape(x_BLD, (B, L, cfg.d_model))
      return from_zigzag_layout(x_BLD) if zigzag else x_BLD
    logits_BLV = embedder.decode(x_BLD)
    logits_BLV = nn.with_logical_constraint(logits_BLV, ("batch", "length", "vocab"))
    chex.assert_shape(logits_BLV, (B, L, cfg.vocab_size))
    return from_zigzag_layout(logits_BLV) if zigzag else logits_BLV

"""Block (attention + FFN/MoE, residuals, norms), the layer stack, the Transformer.

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

from typing import Any, Callable

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from model import positional, remat, telemetry
from model.attention.gqa import Attention
from model.attention.mla import MLA
from model.config import LayerKind, ModelConfig
from model.layers import Embedder, FeedForward, embedding_std, make_norm
from model.moe import layer as moe_layer
from model.moe.layer import MoE
from parallel import pipeline, pipeline_circular
from parallel.context import context_axis_size, from_zigzag_layout, to_zigzag_layout
from parallel.pipeline import stage_axis_size
from parallel.pipeline_1f1b import one_f_one_b
from parallel.rules import without_axis

# Collections whose variables are per layer (stacked on axis 0 when scanned).
LAYER_COLLECTIONS = ("params", "cache", "aux", "moe_state", telemetry.COLLECTION)


def ffn_module(cfg: ModelConfig, is_moe: bool, name: str) -> nn.Module:
  """The FFN slot of a block: the dense FFN or the MoE layer, chosen once."""
  if is_moe:
    return MoE(cfg, name=name)
  return FeedForward(cfg, name=name)


def attention_module(cfg: ModelConfig, kind: LayerKind | None, name: str) -> nn.Module:
  """The attention slot of a block: GQA (model/attention/gqa.py) or MLA (model/attention/mla.py)."""
  if cfg.attention_type == "mla":
    return MLA(cfg, kind, name=name)
  return Attention(cfg, kind, name=name)


def residual_names(cfg: ModelConfig) -> tuple[str, str, str]:
  """The residual stream's logical names between layers: its D split over tensor
  ("residual", parallel/rules.py), except where the vocabulary does not divide over the
  tensor axis (the run spec refuses that; the Python API allows it): there XLA:CPU
  computed wrong activations with the split residual on a (data, fsdp, tensor) mesh
  (tests/train/test_loss.py::test_sharded_over_fsdp_and_tensor_equals_one_device)."""
  even = cfg.vocab_size % context_axis_size("tensor") == 0
  return ("batch", "length", "residual" if even else "embed")


class Block(nn.Module):
  """One pre-norm or post-norm ("Add & Norm") Transformer layer."""

  cfg: ModelConfig
  is_moe: bool = False
  kind: LayerKind | None = None  # None: layer 0's (the whole stack's, without patterns).

  @nn.compact
  def __call__(self, x_BLD, positions_BL, segment_ids_BL, deterministic: bool = True,
               decode: bool = False):
    cfg = self.cfg
    x_BLD = checkpoint_name(x_BLD, "decoder_layer_input")
    attn = attention_module(cfg, self.kind, "attn")
    ffn = ffn_module(cfg, self.is_moe, "ffn")
    drop = nn.Dropout(cfg.dropout_rate, broadcast_dims=())
    norm1, norm2 = make_norm(cfg, "norm1"), make_norm(cfg, "norm2")
    pre = cfg.norm_position == "pre"
    update_BLD = drop(attn(norm1(x_BLD) if pre else x_BLD, positions_BL, segment_ids_BL,
                           decode), deterministic=deterministic)
    x_BLD = x_BLD + update_BLD if pre else norm1(x_BLD + update_BLD)
    ffn_BLD = drop(ffn(norm2(x_BLD) if pre else x_BLD, deterministic=deterministic),
                   deterministic=deterministic)
    x_BLD = x_BLD + ffn_BLD if pre else norm2(x_BLD + ffn_BLD)
    x_BLD = nn.with_logical_constraint(x_BLD, residual_names(cfg))
    if telemetry.enabled(self):  # Each block's updates and the residual stream it leaves.
      telemetry.sow(self, "attn_update_ms", telemetry.mean_square(update_BLD))
      telemetry.sow(self, "ffn_update_ms", telemetry.mean_square(ffn_BLD))
      telemetry.sow(self, "residual_ms", telemetry.mean_square(x_BLD))
    return x_BLD, None


def _block_class(cfg: ModelConfig):
  if cfg.remat == "none":
    return Block
  # static_argnums count `self` as 0: deterministic is 4, decode is 5. Inside a loop of
  # one layer per iteration CSE cannot merge the recomputation with the forward pass;
  # unrolled (scan_unroll > 1, or no scan) it would, keeping every activation alive.
  return nn.remat(Block, policy=remat.policy(cfg.remat, cfg.remat_custom),
                  prevent_cse=not cfg.layers_looped, static_argnums=(4, 5))


class Period(nn.Module):
  """One period of the layer patterns: a block per kind, the body of a scanned segment."""

  cfg: ModelConfig
  is_moe: bool
  kinds: tuple[LayerKind, ...]

  @nn.compact
  def __call__(self, x_BLD, positions_BL, segment_ids_BL, deterministic: bool = True,
               decode: bool = False):
    block_cls = _block_class(self.cfg)
    for j, kind in enumerate(self.kinds):
      x_BLD, _ = block_cls(self.cfg, self.is_moe, kind, name=f"block_{j}")(
          x_BLD, positions_BL, segment_ids_BL, deterministic, decode)
    return x_BLD, None


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


def _scanned(cfg: ModelConfig, is_moe: bool, kinds: tuple[LayerKind, ...], n: int):
  """The scanned body over n layers (n / M periods of the patterns' M kinds) and its args."""
  M = len(kinds)
  body, args = (_block_class(cfg), (is_moe, kinds[0])) if M == 1 else (Period, (is_moe, kinds))
  stack = nn.scan(
      body, variable_axes={c: 0 for c in LAYER_COLLECTIONS},
      split_rngs={"params": True, "dropout": True}, in_axes=(nn.broadcast,) * 4,
      length=n // M, unroll=min(cfg.scan_unroll, n // M),
      metadata_params={nn.PARTITION_NAME: "layers"})
  return stack, args


class StageStack(nn.Module):
  """One pipeline stage's n layers of the segment `segment`: its variables under
  {segment: [n / M, ...]}, as Transformer's (the stage's share of them)."""

  cfg: ModelConfig
  segment: str
  is_moe: bool
  kinds: tuple[LayerKind, ...]
  n: int

  @nn.compact
  def __call__(self, x_BLD, positions_BL, segment_ids_BL, deterministic: bool = True):
    stack, args = _scanned(self.cfg, self.is_moe, self.kinds, self.n)
    x_BLD, _ = stack(self.cfg, *args, name=self.segment)(x_BLD, positions_BL, segment_ids_BL,
                                                         deterministic, False)
    return x_BLD


def _stage_fn(cfg: ModelConfig, name: str, is_moe: bool, kinds: tuple[LayerKind, ...]):
  """A pipeline's stage_fn: one stage's `StageStack` of the segment `name` on its
  variables ({collection: {name: [n / S, ...]}}); returns the output and what the
  layers sowed in "aux" ({} for a dense segment)."""
  def stage_fn(stage_vars, x_bLD, extras, k):
    n_stage = jax.tree.leaves(stage_vars["params"])[0].shape[0] * len(kinds)
    module = StageStack(cfg, name, is_moe, kinds, n_stage)
    y_bLD, mutated = module.apply(stage_vars, x_bLD, *extras, k is None, mutable=["aux"],
                                  rngs=None if k is None else {"dropout": k})
    return y_bLD, mutated.get("aux", {})
  return stage_fn


def _pipelined_stack(cfg: ModelConfig, name: str, is_moe: bool, kinds: tuple[LayerKind, ...],
                     variables: dict, x_BLD, positions_BL, segment_ids_BL, key,
                     microbatches: int, repeats: int = 1):
  """The scanned segment `name` as a pipeline over the mesh's stage axis: the batch cut
  into `microbatches` (0: one per stage). repeats=1: GPipe, each stage applying its
  contiguous n / S layers (a `StageStack`) and passing the result on; repeats=R > 1: the
  circular schedule (parallel/pipeline_circular.py; dense segments only), each stage
  applying one of its R chunks of n / (S R) layers per tick, with the stack in its
  pipeline order. `variables`: the segment's {collection: [n / M, ...] stack} (params,
  and an MoE's router biases). Returns the output and the segment's "aux" as the
  unpipelined stack sows it (MoE loads and losses over the whole batch, layers stacked in
  order; {} for a dense segment)."""
  M = microbatches or stage_axis_size()
  mb = lambda x: pipeline.to_microbatches(x, M)
  stage_fn = _stage_fn(cfg, name, is_moe, kinds)
  args = (mb(x_BLD), (mb(positions_BL), mb(segment_ids_BL)), key)
  if repeats > 1:
    out_MbLD = pipeline_circular.circular(lambda *a: stage_fn(*a)[0], variables, *args,
                                          repeats=repeats)
    aux_S = {}
  else:
    out_MbLD, aux_S = pipeline.gpipe(stage_fn, variables, *args)
  # [S, layers per stage, ...] -> [layers, ...]: stage s holds the s-th block of layers.
  aux_sum = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), aux_S)
  aux = moe_layer.aux_from_microbatch_sums(aux_sum, M, cfg) if aux_sum else {}
  out_BLD = pipeline.from_microbatches(out_MbLD)
  return nn.with_logical_constraint(out_BLD, ("batch", "length", "embed")), aux


def _pipelined_loss(cfg: ModelConfig, name: str, kinds: tuple[LayerKind, ...], params,
                    x_BLD, positions_BL, segment_ids_BL, key, microbatches: int,
                    pipeline_loss) -> tuple[jax.Array, Any]:
  """The one dense scanned segment `name`, the final norm and the caller's loss as a 1F1B
  pipeline (parallel/pipeline_1f1b.py): pipeline_loss = (loss_fn, extras_B, lockstep),
  loss_fn({"embedder": ...}, hidden_bLD, extras_b) -> (loss, stats) on one microbatch's
  final-normed hidden states, lockstep: parallel/pipeline_1f1b_lockstep.py's schedule;
  returns the losses summed and the stats stacked [M, ...]."""
  M = microbatches or stage_axis_size()
  loss_fn, extras_B, lockstep = pipeline_loss
  stage_fn = _stage_fn(cfg, name, False, kinds)

  def tail_fn(tail_params, y_bLD, extras_b):
    with without_axis(pipeline.AXIS):  # Traced inside the schedule's shard_map (manual).
      if cfg.norm_position == "pre":
        y_bLD = make_norm(cfg).apply({"params": tail_params["final_norm"]}, y_bLD)
      return loss_fn({"embedder": tail_params["embedder"]}, y_bLD, extras_b)

  def layers_fn(*args):
    with without_axis(pipeline.AXIS):  # As tail_fn.
      return stage_fn(*args)[0]

  tail_params = {k: params[k] for k in ("final_norm", "embedder") if k in params}
  mb = lambda tree: jax.tree.map(lambda x: pipeline.to_microbatches(x, M), tree)
  return one_f_one_b(layers_fn, tail_fn, {"params": {name: params[name]}},
                     tail_params, mb(x_BLD),
                     (mb(positions_BL), mb(segment_ids_BL)), mb(extras_B), key,
                     lockstep=lockstep)


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
    pipeline_repeats: R > 1 runs the circular schedule, and then the scanned stack's rows
    must be in its pipeline order (parallel/pipeline_circular.py; a train state holds them
    so while it trains, train/state.py PipelineOrder); 1: GPipe, rows in layer order.
    pipeline_loss: under a stage axis, run the 1F1B schedule, which owns the loss, and
    return `_pipelined_loss`'s (loss, stats_M) instead (train/step.py; None: GPipe)."""
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

    block_cls, M = _block_class(cfg), cfg.layer_period
    # Under a stage axis each scanned segment is a pipeline (parallel/pipeline*.py).
    stages = stage_axis_size() if not decode and not self.is_initializing() else 1
    for name, first, n, is_moe in layer_segments(cfg):
      kinds = tuple(cfg.layer_kind(i) for i in range(first, first + M))
      key = None if deterministic or stages == 1 else self.make_rng("dropout")
      if stages > 1 and pipeline_loss is not None:  # 1F1B: the loss inside (one segment).
        return _pipelined_loss(cfg, name, kinds, self.variables["params"], x_BLD,
                               positions_BL, segment_ids_BL, key, pipeline_microbatches,
                               pipeline_loss)
      if stages > 1:
        variables = {c: {name: self.variables[c][name]} for c in ("params", "moe_state")
                     if name in self.variables.get(c, {})}  # With its router biases.
        x_BLD, aux = _pipelined_stack(cfg, name, is_moe, kinds, variables, x_BLD,
                                      positions_BL, segment_ids_BL, key,
                                      pipeline_microbatches, pipeline_repeats)
        if aux and self.is_mutable_collection("aux"):
          self.put_variable("aux", name, aux[name])
      elif cfg.scan_layers:
        stack, args = _scanned(cfg, is_moe, kinds, n)
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

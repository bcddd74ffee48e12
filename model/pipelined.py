"""A scanned segment of the layer stack run as a pipeline over the mesh's stage axis
(parallel/pipeline*.py): GPipe or the circular schedule (`pipelined_stack`), or a 1F1B
schedule that owns the loss (`pipelined_loss`). model/transformer.py calls them for each
segment under a stage axis."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax

from model.block import scanned
from model.config import LayerKind, ModelConfig
from model.layers import make_norm
from model.moe import layer as moe_layer
from parallel import pipeline, pipeline_circular
from parallel.pipeline import stage_axis_size
from parallel.pipeline_1f1b import one_f_one_b
from parallel.rules import without_axis


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
    stack, args = scanned(self.cfg, self.is_moe, self.kinds, self.n)
    x_BLD, _ = stack(self.cfg, *args, name=self.segment)(x_BLD, positions_BL, segment_ids_BL,
                                                         deterministic, False)
    return x_BLD


def _stage_fn(cfg: ModelConfig, name: str, is_moe: bool, kinds: tuple[LayerKind, ...]):
  """A pipeline's stage_fn: one stage's `StageStack` of the segment `name` on its
  variables ({collection: {name: [n / S, ...]}}, or one chunk's [n / (S R), ...] in the
  circular schedule); returns the output and what the
  layers sowed in "aux" ({} for a dense segment)."""
  def stage_fn(stage_vars, x_bLD, extras, k):
    n_stage = jax.tree.leaves(stage_vars["params"])[0].shape[0] * len(kinds)
    module = StageStack(cfg, name, is_moe, kinds, n_stage)
    y_bLD, mutated = module.apply(stage_vars, x_bLD, *extras, k is None, mutable=["aux"],
                                  rngs=None if k is None else {"dropout": k})
    return y_bLD, mutated.get("aux", {})
  return stage_fn


def pipelined_stack(cfg: ModelConfig, name: str, is_moe: bool, kinds: tuple[LayerKind, ...],
                     variables: dict, x_BLD, positions_BL, segment_ids_BL, key,
                     microbatches: int, repeats: int = 1):
  """The scanned segment `name` as a pipeline over the mesh's stage axis: the batch cut
  into `microbatches` (0: one per stage). repeats=1: GPipe, each stage applying its
  contiguous n / S layers (a `StageStack`) and passing the result on; repeats=R > 1: the
  circular schedule (parallel/pipeline_circular.py), each stage applying one of its R
  chunks of n / (S R) layers per tick, with the parameters in its pipeline order (the
  other collections, an MoE's router biases, in layer order). `variables`: the segment's
  {collection: [n / M, ...] stack} (params, and an MoE's router biases). Returns the
  output and the segment's "aux" as the unpipelined stack sows it (MoE loads and losses
  over the whole batch, layers stacked in order; {} for a dense segment)."""
  M = microbatches or stage_axis_size()
  mb = lambda x: pipeline.to_microbatches(x, M)
  stage_fn = _stage_fn(cfg, name, is_moe, kinds)
  args = (mb(x_BLD), (mb(positions_BL), mb(segment_ids_BL)), key)
  # The circular schedule's parameters come in pipeline order (the trainer's), its router
  # biases in layer order (replicated in the state: train/state.py PipelineOrder leaves
  # them); the schedule reads both in pipeline order, and the aux leaves in layer order.
  order = lambda f, tree: jax.tree.map(lambda a: f(a, stage_axis_size(), repeats), tree)
  if repeats > 1:
    variables = {c: v if c == "params" else order(pipeline_circular.to_pipeline_order, v)
                 for c, v in variables.items()}
    out_MbLD, aux_S = pipeline_circular.circular(stage_fn, variables, *args, repeats=repeats)
  else:
    out_MbLD, aux_S = pipeline.gpipe(stage_fn, variables, *args)
  # [S, layers per stage, ...] -> [layers, ...]: stage s holds the s-th block of rows.
  aux_sum = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), aux_S)
  aux_sum = order(pipeline_circular.to_layer_order, aux_sum) if repeats > 1 else aux_sum
  aux = moe_layer.aux_from_microbatch_sums(aux_sum, M, cfg) if aux_sum else {}
  out_BLD = pipeline.from_microbatches(out_MbLD)
  return nn.with_logical_constraint(out_BLD, ("batch", "length", "embed")), aux


def pipelined_loss(cfg: ModelConfig, name: str, is_moe: bool, kinds: tuple[LayerKind, ...],
                    variables: dict, x_BLD, positions_BL, segment_ids_BL, key,
                    microbatches: int, pipeline_loss) -> tuple[jax.Array, Any, dict]:
  """The one scanned segment `name`, the final norm and the caller's loss as a 1F1B
  pipeline (parallel/pipeline_1f1b.py): pipeline_loss = (loss_fn, extras_B, schedule,
  aux_weight), loss_fn({"embedder": ...}, hidden_bLD, extras_b) -> (loss, stats) on one
  microbatch's final-normed hidden states, schedule: ("1f1b", "1f1b_lockstep" or
  "zero_bubble", the zero-bubble schedule's stash: `one_f_one_b`'s), aux_weight: the weight of an MoE's aux losses in the
  loss (each microbatch's stage adds its layers' / M, differentiated in its backward).
  `variables`: as `pipelined_stack`'s, and the model's "final_norm" and "embedder" params.
  Returns the losses summed, the stats stacked [M, ...] and the segment's aux as
  `pipelined_stack`."""
  M = microbatches or stage_axis_size()
  loss_fn, extras_B, (schedule, stash), aux_weight = pipeline_loss
  stage_fn = _stage_fn(cfg, name, is_moe, kinds)
  params = variables["params"]

  def tail_fn(tail_params, y_bLD, extras_b):
    with without_axis(pipeline.AXIS):  # Traced inside the schedule's shard_map (manual).
      if cfg.norm_position == "pre":
        y_bLD = make_norm(cfg).apply({"params": tail_params["final_norm"]}, y_bLD)
      return loss_fn({"embedder": tail_params["embedder"]}, y_bLD, extras_b)

  def layers_fn(*args):
    with without_axis(pipeline.AXIS):  # As tail_fn.
      return stage_fn(*args)

  stack = {c: {name: v[name]} for c, v in variables.items() if name in v}
  tail_params = {k: params[k] for k in ("final_norm", "embedder") if k in params}
  mb = lambda tree: jax.tree.map(lambda x: pipeline.to_microbatches(x, M), tree)
  aux_loss_fn = lambda aux: moe_layer.total_aux_loss(aux) * (aux_weight / M)
  loss, stats_M, aux_S = one_f_one_b(
      layers_fn, tail_fn, stack, tail_params, mb(x_BLD), (mb(positions_BL),
      mb(segment_ids_BL)), mb(extras_B), key, schedule=schedule, stash=stash, aux_loss_fn=aux_loss_fn)
  aux_sum = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), aux_S)  # As GPipe's.
  return loss, stats_M, moe_layer.aux_from_microbatch_sums(aux_sum, M, cfg) if aux_sum else {}

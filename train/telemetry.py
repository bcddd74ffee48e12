"""Per-layer stability telemetry inside the train step (train.telemetry, default on).

Every step computes, from what the forward and the update already hold (under the
step's shardings, no extra pass over activations or logits):

  telemetry/attn_logit_max      [layers] the largest attention logit (after soft-cap and
                                score biases, before the softmax; model/telemetry.py)
  telemetry/residual_rms        [layers] RMS of the residual stream each block leaves
  telemetry/attn_update_rms     [layers] RMS of each block's attention update
  telemetry/ffn_update_rms      [layers] RMS of each block's FFN (or MoE) update
  telemetry/{grad,param}_rms/<group>, telemetry/update_ratio/<group>: per parameter
                                group, RMS of the gradient (before clipping), of the
                                parameters (before the update) and RMS(update) /
                                RMS(parameters); groups attn and ffn are [layers], embed
                                (embeddings and head) and norm (every norm scale) scalars
  telemetry/router_entropy      [MoE layers] mean router entropy (nats; ln E: uniform)
  telemetry/expert_load_max     [MoE layers] the busiest expert's share of routed pairs

and train/step.py adds the output logits' telemetry/logit_max, logit_mean, logz_mean.
The trainer logs each [layers] vector as scalars `<key>/L<i>` (model layer i; MoE
vectors start at first_k_dense): `per_layer_scalars`. docs/stability.md reads them.

`Profiler`: a jax.profiler trace of the steps train.profile_steps names, into RUN/profile/.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from train.io import staging, storage

log = logging.getLogger(__name__)

from model import ModelConfig
from model.moe import layer as moe
from model.telemetry import COLLECTION
from model.transformer import layer_segments, unstack_layers

PREFIX = "telemetry/"
MOE_KEYS = (PREFIX + "router_entropy", PREFIX + "expert_load_max")  # Over MoE layers only.
LAYER_GROUPS = ("attn", "ffn")  # Per-layer parameter groups; the rest: embed, norm.


def _leaves(tree: Mapping, out: dict) -> dict:
  """{sown name: value} of one layer's subtree (a sow tuple holds one call's value)."""
  for key, value in tree.items():
    if isinstance(value, Mapping):
      _leaves(value, out)
    else:
      out[key] = value[0] if isinstance(value, (tuple, list)) else value
  return out


def layer_vectors(model_cfg: ModelConfig, mutated: Mapping) -> dict[str, jax.Array]:
  """The forward's sown telemetry (`mutated`: apply's mutated collections) as
  {name: [num_layers] float32}; a name some layer did not sow is left out."""
  layers = unstack_layers(model_cfg, dict(mutated.get(COLLECTION, {})))
  per: dict[str, list] = {}
  for i in range(model_cfg.num_layers):
    for name, v in _leaves(layers.get(f"layer_{i}", {}), {}).items():
      per.setdefault(name, []).append(v)
  return {k: jnp.stack(vs) for k, vs in per.items() if len(vs) == model_cfg.num_layers}


def combine(a: dict, b: dict) -> dict:
  """Two micro-batches' `layer_vectors`: maxes of "_max", sums of the rest."""
  return {k: jnp.maximum(a[k], b[k]) if k.endswith("_max") else a[k] + b[k] for k in a}


def empty_like(vectors: dict) -> dict:
  """The accumulation's start: -inf for maxes, 0 for sums."""
  return {k: jnp.full_like(v, -jnp.inf if k.endswith("_max") else 0.0)
          for k, v in vectors.items()}


def finish(vectors: dict, accum: int) -> dict[str, jax.Array]:
  """Metrics from (accumulated) `layer_vectors`: mean squares -> RMS over micro-batches."""
  out = {}
  for k, v in vectors.items():
    if k.endswith("_ms"):
      out[f"{PREFIX}{k[:-3]}_rms"] = jnp.sqrt(v / accum)
    else:
      out[PREFIX + k] = v
  return out


def _square_sums(model_cfg: ModelConfig, tree: Mapping) -> dict:
  """Per leaf (sum of squares, element count), over all but the layer axis of a scanned
  segment's stacked leaves; then in the unscanned layout (`layer_{i}` entries)."""
  stacked = {name for name, *_ in layer_segments(model_cfg)} if model_cfg.scan_layers else ()

  def reduce(x, axis0: bool):
    axes = tuple(range(1 if axis0 else 0, x.ndim))
    sq = jnp.sum(jnp.square(x.astype(jnp.float32)), axes)
    return sq, jnp.full(sq.shape, x.size // (x.shape[0] if axis0 else 1), jnp.float32)

  sums = {k: jax.tree.map(lambda x, s=k in stacked: reduce(x, s), v) for k, v in tree.items()}
  return unstack_layers(model_cfg, sums)


def _total(tree) -> tuple[jax.Array, jax.Array]:
  pairs = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, tuple))
  return sum(p[0] for p in pairs), sum(p[1] for p in pairs)


def group_rms(model_cfg: ModelConfig, tree: Mapping) -> dict[str, jax.Array]:
  """RMS of a parameter-shaped tree (params, grads, updates) per group: "attn" and "ffn"
  [num_layers] (each layer's attention / FFN or MoE parameters), "embed" (everything
  outside the layers but the final norm) and "norm" (every norm scale) scalars."""
  sums = _square_sums(model_cfg, tree)
  layer_sums = {g: [] for g in LAYER_GROUPS}
  rest = {"embed": [], "norm": []}
  for i in range(model_cfg.num_layers):
    layer = dict(sums.pop(f"layer_{i}"))
    for g in LAYER_GROUPS:
      layer_sums[g].append(_total(layer.pop(g)))
    rest["norm"].append(_total(layer))  # norm1 / norm2 (and any other per-layer leaf).
  for k, v in sums.items():
    rest["norm" if "norm" in k else "embed"].append(_total(v))
  out = {g: jnp.sqrt(jnp.stack([s for s, _ in v]) / jnp.stack([n for _, n in v]))
         for g, v in layer_sums.items()}
  for g, v in rest.items():
    if v:
      out[g] = jnp.sqrt(sum(s for s, _ in v) / sum(n for _, n in v))
  return out


def parameter_metrics(model_cfg: ModelConfig, params, grads, updates) -> dict[str, jax.Array]:
  """grad_rms, param_rms and update_ratio per group (`group_rms`), under PREFIX."""
  g, p, u = (group_rms(model_cfg, t) for t in (grads, params, updates))
  out = {}
  for k in p:
    out[f"{PREFIX}grad_rms/{k}"] = g[k]
    out[f"{PREFIX}param_rms/{k}"] = p[k]
    out[f"{PREFIX}update_ratio/{k}"] = u[k] / jnp.maximum(p[k], 1e-30)
  return out


def moe_telemetry(aux: Any) -> dict[str, jax.Array]:
  """Router entropy and the busiest expert's share of the routed pairs, per MoE layer."""
  loads_YE = moe.expert_loads(aux)
  if loads_YE.size == 0:
    return {}
  share_Y = loads_YE.max(-1) / jnp.maximum(loads_YE.sum(-1), 1.0)
  return {MOE_KEYS[0]: moe.router_entropies(aux), MOE_KEYS[1]: share_Y}


def per_layer_scalars(metrics: Mapping, first_moe_layer: int) -> dict:
  """Host metrics with each telemetry vector spread into scalars `<key>/L<i>` (model layer
  i): what metrics.jsonl, TensorBoard (a scalar family per key) and W&B get."""
  out = {}
  for k, v in metrics.items():
    if k.startswith(PREFIX) and getattr(v, "ndim", 0) == 1:
      first = first_moe_layer if k in MOE_KEYS else 0
      out.update({f"{k}/L{first + j}": x for j, x in enumerate(v)})
    else:
      out[k] = v
  return out


class Profiler:
  """A jax.profiler trace of train.profile_steps steps into RUN/profile/, starting at
  train.profile_start (0: the first step this attempt runs; compilation happens before
  it, outside the trace). Steps carry StepTraceAnnotations ("train", step_num). On a
  bucket the trace (files jax.profiler writes) is written locally, then each of its
  files uploaded once, whole, by the process that wrote it (train/io/staging.py)."""

  def __init__(self, workdir, train_cfg, start: int):
    self.steps = int(train_cfg.profile_steps)
    self.first = max(int(train_cfg.profile_start), start + 1)
    self.last = self.first + self.steps - 1
    self.dir = storage.join(workdir, "profile")
    self.local = None  # The trace's local stand-in for a bucket's RUN/profile.
    self.active = False

  def before(self, step: int) -> None:
    if self.steps and step == self.first:
      if storage.is_url(self.dir):
        self.local = tempfile.mkdtemp(prefix="run-profile-")
      jax.profiler.start_trace(self.local or self.dir)
      self.active = True

  def after(self, step: int, metrics) -> None:
    if self.active and step == self.last:
      jax.block_until_ready(metrics)  # The trace holds the whole last step.
      self.close()
      log.info("profiled steps %d-%d into %s", self.first, self.last, self.dir)

  def close(self) -> None:
    """Ends the trace (an early exit too: preemption, error), so that it is written."""
    if not self.active:
      return
    jax.profiler.stop_trace()
    self.active = False
    if self.local:
      staging.upload_dir(self.local, self.dir)
      shutil.rmtree(self.local, ignore_errors=True)
      self.local = None

"""Mixture-of-Experts FFN layer, and the functions the trainer calls on its diagnostics.

The layer: router (model/moe/router.py) -> dispatch strategy chosen once from
`cfg.moe_dispatch` (model/moe/dispatch.py) -> plus always-active shared experts.

Capacity factors: `deterministic=False` (training) uses `capacity_factor`,
`deterministic=True` (eval, prefill, decode) uses `eval_capacity_factor`
(None: the training factor). 0 means no drops. Groups are single sequences, so
single-token decode steps never drop; for prefill/eval set `eval_capacity_factor`
to 0 (or large) or use `moe_dispatch="dropless"` if drops must not change results.

Diagnostics are outputs, sown per MoE layer into the "aux" collection:

  router/moe_expert_load  [E] routed (token, expert) pairs per expert, before drops
  router/moe_lb_loss      Switch/GShard loss E * sum_i f_i P_i (unweighted)
  router/moe_seq_loss     DeepSeek-V3 sequence-wise balance loss (unweighted)
  router/moe_z_loss       ST-MoE router z-loss (unweighted)
  router/moe_aux_loss     what this layer adds to the loss (coefficients applied)
  router/moe_router_entropy  mean over tokens of the router distribution's entropy (nats)
  router/moe_mean_prob    [E] mean over tokens of the normalised router scores (P_i)
  moe_dropped_frac        fraction of (token, expert) pairs dropped for capacity

Get them with `logits, mutated = model.apply(variables, ..., mutable=["aux"])`;
`mutated` or `mutated["aux"]` can be handed to the functions below (nested by module
path, stacked over layers when scanned, tuple-wrapped by `sow`). Loss-free balancing
biases live in the "moe_state" collection at the same path as moe_expert_load.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from model.moe import router as router_lib
from model.config import ModelConfig
from model.moe.dispatch import DISPATCH, ExpertWeights
from model.layers import FeedForward, is_gated

DROPPED = "moe_dropped_frac"


class MoE(nn.Module):
  """x_BLD -> y_BLD: routed experts (weights [E, D, F]) plus shared experts."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BLD: jax.Array, deterministic: bool = True) -> jax.Array:
    cfg = self.cfg
    chex.assert_rank(x_BLD, 3)
    E, D, F = cfg.num_experts, cfg.d_model, cfg.resolved_expert_mlp_dim
    dtype = jnp.dtype(cfg.dtype)
    routing = router_lib.Router(cfg, name="router")(x_BLD)

    def weight(name, shape, axes):
      init = nn.with_logical_partitioning(nn.initializers.normal(cfg.init_std), axes)
      return self.param(name, init, shape, jnp.dtype(cfg.param_dtype)).astype(dtype)

    gated = is_gated(cfg.ffn)
    w = ExpertWeights(
        wi_EDF=weight("wi", (E, D, F), ("expert", "expert_embed", "mlp")),
        wg_EDF=weight("wg", (E, D, F), ("expert", "expert_embed", "mlp")) if gated else None,
        wo_EFD=weight("wo", (E, F, D), ("expert", "mlp", "expert_embed")))
    factor = cfg.capacity_factor
    if deterministic and cfg.eval_capacity_factor is not None:
      factor = cfg.eval_capacity_factor
    y_BLD, dropped = DISPATCH[cfg.moe_dispatch](x_BLD.astype(dtype), routing, w, cfg.ffn,
                                                factor)
    if not self.is_initializing():
      self.sow("aux", DROPPED, dropped)
    if cfg.num_shared_experts:
      shared_cfg = cfg.replace(mlp_dim=cfg.num_shared_experts * F)
      y_BLD = y_BLD + FeedForward(shared_cfg, name="shared")(x_BLD, deterministic)
    chex.assert_equal_shape([x_BLD, y_BLD])
    return y_BLD.astype(dtype)


# Functions on the "aux" collection (called by the trainer and the eval loop) -------
def _unwrap(tree: Any, collection: str) -> Mapping:
  tree = tree or {}
  if set(tree) == {collection}:
    return tree[collection]
  return tree


def _find(tree: Any, name: str, path: tuple[str, ...] = ()) -> Iterator[
    tuple[tuple[str, ...], jax.Array]]:
  """(module path, value) for every `name` entry, sow tuples summed (one call = one entry)."""
  for key, value in tree.items():
    if key == name:
      parts = list(value) if isinstance(value, (tuple, list)) else [value]
      yield path, sum(jnp.asarray(p, jnp.float32) for p in parts)
    elif isinstance(value, Mapping):
      yield from _find(value, name, path + (key,))


_BLOCK = re.compile(r"block_\d+")  # A block of a scanned period (model/block.py).


def _layer_order(path: tuple[str, ...]) -> tuple:
  """Sort key: layer_2 before layer_10 (jit and grad return dicts sorted as strings)."""
  return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", "/".join(path)))


def _found(aux: Any, name: str) -> list[jax.Array]:
  """Every `name` entry, in layer order (a scanned stack is one entry, layers on axis 0).

  A scanned period of the layer patterns (model/block.py) holds M entries
  `block_{j}`, each [repeats, ...]: layer r * M + j is row r of block j, so they interleave.
  """
  found = sorted(_find(_unwrap(aux, "aux"), name), key=lambda f: _layer_order(f[0]))
  groups: dict[tuple[str, ...], list[jax.Array]] = {}
  for path, v in found:
    cut = next((i for i, p in enumerate(path) if _BLOCK.fullmatch(p)), len(path))
    groups.setdefault(path[:cut], []).append(v)
  return [vs[0] if len(vs) == 1 else jnp.stack(vs, 1).reshape(-1, *vs[0].shape[1:])
          for vs in groups.values()]


def _per_layer(aux: Any, name: str) -> jax.Array | None:
  """The `name` values of every MoE layer as one flat [layers] vector (None if absent)."""
  found = [jnp.ravel(v) for v in _found(aux, name)]
  return jnp.concatenate(found) if found else None


def total_aux_loss(aux: Any) -> jax.Array:
  """Sum over MoE layers of the coefficient-weighted aux losses; 0 for a dense model."""
  losses = _per_layer(aux, router_lib.AUX_LOSS)
  return jnp.zeros((), jnp.float32) if losses is None else losses.sum()


def expert_loads(aux: Any) -> jax.Array:
  """loads_YE: routed pairs per expert, one row per MoE layer; [0, 0] for a dense model.

  Sum it over eval batches and pass it to `maxvio` for MaxVio_global.
  """
  found = _found(aux, router_lib.LOAD)
  if not found:
    return jnp.zeros((0, 0), jnp.float32)
  return jnp.concatenate([v.reshape(-1, v.shape[-1]) for v in found])


def router_entropies(aux: Any) -> jax.Array:
  """[MoE layers] mean router entropy (nats), in the layer order of expert_loads."""
  values = _per_layer(aux, router_lib.ENTROPY)
  return jnp.zeros((0,), jnp.float32) if values is None else values


def router_biases(model_state: Any) -> jax.Array:
  """biases_YE: the loss-free balancing bias per expert, one row per MoE layer, in the
  layer order of expert_loads; [0, 0] when there are none (the trainer's histograms)."""
  found = _found(_unwrap(model_state, "moe_state"), router_lib.BIAS)
  if not found:
    return jnp.zeros((0, 0), jnp.float32)
  return jnp.concatenate([v.reshape(-1, v.shape[-1]) for v in found])


def maxvio_per_layer(loads_YE: jax.Array) -> jax.Array:
  """vio_L = max_i load_i / mean_i load_i - 1 for each layer (0: perfectly balanced)."""
  loads_YE = jnp.asarray(loads_YE, jnp.float32)
  mean_Y = loads_YE.mean(-1)
  return jnp.where(mean_Y > 0, loads_YE.max(-1) / jnp.where(mean_Y > 0, mean_Y, 1.0) - 1, 0.0)


def maxvio(loads_YE: jax.Array) -> jax.Array:
  """Mean over layers of max_i load_i / mean_i load_i - 1 (0: perfectly balanced)."""
  loads_YE = jnp.asarray(loads_YE, jnp.float32)
  if loads_YE.size == 0:
    return jnp.zeros((), jnp.float32)
  return maxvio_per_layer(loads_YE).mean()


LOAD_METRIC = "moe_load"
PER_LAYER_METRICS = ("moe_maxvio", DROPPED, router_lib.LB_LOSS, router_lib.SEQ_LOSS,
                     router_lib.Z_LOSS, router_lib.AUX_LOSS, router_lib.ENTROPY)


def moe_metrics(aux: Any, first_layer: int = 0) -> dict[str, jax.Array]:
  """What the trainer logs; {} for a dense model. MoE layer j is model layer
  `first_layer + j` (pass `cfg.first_k_dense`). For each name in PER_LAYER_METRICS:

    <name>                 mean over MoE layers (scalar)
    <name>/layer<i>        model layer i's value (scalar)
    moe_load/layer<i>      [E] routed (token, expert) pairs per expert, before drops
    moe_load               [E] per-layer loads sorted busiest first, mean over layers:
                           the load profile (expert i of one layer is unrelated to expert
                           i of another, so a plain sum over layers would mean nothing)
  """
  loads_YE = expert_loads(aux)
  if loads_YE.size == 0:
    return {}
  per_layer = {"moe_maxvio": maxvio_per_layer(loads_YE)}
  for name in PER_LAYER_METRICS[1:]:
    values = _per_layer(aux, name)
    if values is not None:
      per_layer[name] = values
  metrics = {name: values.mean() for name, values in per_layer.items()}
  metrics[LOAD_METRIC] = -jnp.sort(-loads_YE, axis=-1).mean(0)
  for j in range(loads_YE.shape[0]):
    metrics.update({f"{name}/layer{first_layer + j}": v[j] for name, v in per_layer.items()})
    metrics[f"{LOAD_METRIC}/layer{first_layer + j}"] = loads_YE[j]
  return metrics


def router_bias_metrics(model_state: dict) -> dict[str, jax.Array]:
  """Size of the loss-free balancing biases (all MoE layers), {} when there are none:

    moe_bias_norm   global L2 norm of every layer's bias
    moe_bias_max    largest |b_i|

  The bias moves at most `bias_update_rate` per step, so these show whether it has
  had time to grow to the size balance needs (docs/moe.md, "Loss-free balancing").
  """
  biases = [b for _, b in _find(_unwrap(model_state, "moe_state"), router_lib.BIAS)]
  if not biases:
    return {}
  flat = jnp.concatenate([jnp.ravel(b) for b in biases])
  return {"moe_bias_norm": jnp.sqrt(jnp.sum(flat ** 2)), "moe_bias_max": jnp.abs(flat).max()}


def aux_from_microbatch_sums(aux_sum: Mapping, microbatches: int, cfg: ModelConfig) -> dict:
  """The aux a batch's forward pass sows, from the sums of its `microbatches` equal
  microbatches' aux (a pipeline's, parallel/pipeline.py): the loads stay sums; every other
  entry is a mean over tokens or sequences, so the sum / M; the Switch loss (a product of
  batch means, not a mean) is rebuilt from the loads and P, and the weighted aux loss from
  the rebuilt parts. Same tree (sow tuples, stacked layers) as `aux_sum`."""
  def combine(tree: Mapping) -> dict:
    out = {key: combine(value) if isinstance(value, Mapping) else value if key == router_lib.LOAD
           else jax.tree.map(lambda v: v / microbatches, value) for key, value in tree.items()}
    if router_lib.LOAD in out and router_lib.MEAN_PROB in out:
      (load,), (prob,), (seq,), (z,) = (out[k] for k in (
          router_lib.LOAD, router_lib.MEAN_PROB, router_lib.SEQ_LOSS, router_lib.Z_LOSS))
      lb = router_lib.balance_of(load, prob)
      out[router_lib.LB_LOSS] = (lb,)
      out[router_lib.AUX_LOSS] = (router_lib.weighted_aux_loss(lb, seq, z, cfg),)
    return out

  return combine(aux_sum)


def update_moe_state(model_state: dict, aux: Any, cfg: ModelConfig) -> dict:
  """Loss-free balancing after an optimizer step: b_i += u * sign(mean_load - load_i).

  `model_state` is {"moe_state": ...} or {}; `aux` holds the loads of the whole global
  batch (averaged over micro-batches: sign() does not care about the scale).
  """
  if cfg.load_balance != "loss_free" or not model_state:
    return model_state
  loads = dict(_find(_unwrap(aux, "aux"), router_lib.LOAD))
  if not loads:
    raise ValueError("update_moe_state: aux holds no expert loads; apply the model with "
                     "mutable=['aux'] and pass what it returns")

  def update(tree: Mapping, path: tuple[str, ...]) -> dict:
    out = {}
    for key, value in tree.items():
      if isinstance(value, Mapping):
        out[key] = update(value, path + (key,))
      elif key == router_lib.BIAS:
        if path not in loads:
          raise ValueError(f"update_moe_state: no {router_lib.LOAD} in aux at {'/'.join(path)}")
        load = loads[path].reshape(value.shape)
        step = jnp.sign(load.mean(-1, keepdims=True) - load)
        out[key] = (value + cfg.bias_update_rate * step).astype(value.dtype)
      else:
        out[key] = value
    return out

  return {**model_state, "moe_state": update(model_state["moe_state"], ())}

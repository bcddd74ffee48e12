"""The MoE router: scores, (group-limited, bias-steered) top-R selection, gates, aux losses.

Everything here runs in float32 whatever the compute dtype: a softmax or sigmoid
over E experts in bfloat16 flips near-tied choices and makes the balance losses noisy.

Selection and gating are kept apart on purpose (loss-free balancing, Wang et al. 2024;
DeepSeek-V3): the per-expert bias steers WHICH experts are chosen, while the gate
weights come from the unbiased scores, so the bias never changes what a chosen
expert's output is worth and needs no gradient.
"""

from __future__ import annotations

from typing import NamedTuple

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.scipy.special import xlogy

from model.config import ModelConfig
from model.layers import Einsum

# Names of the per-layer diagnostics sown into the "aux" collection (see model/moe/layer.py).
LOAD, LB_LOSS, SEQ_LOSS, Z_LOSS, AUX_LOSS, ENTROPY, MEAN_PROB = (
    "moe_expert_load", "moe_lb_loss", "moe_seq_loss", "moe_z_loss", "moe_aux_loss",
    "moe_router_entropy", "moe_mean_prob")
BIAS = "bias"  # The loss-free balancing bias, collection "moe_state", next to LOAD.


class Routing(NamedTuple):
  """The router's decision for a batch of sequences (all float32 but the indices)."""

  indices_BLR: jax.Array  # int32 chosen experts, best first.
  gates_BLR: jax.Array  # weights of the chosen experts' outputs.
  probs_BLE: jax.Array  # unbiased scores normalised to sum to 1 per token (balance losses).
  logits_BLE: jax.Array


def scores_of(logits_BLE: jax.Array, kind: str) -> jax.Array:
  """softmax (Switch, Mixtral) or sigmoid (DeepSeek-V3) affinities, float32."""
  logits_BLE = logits_BLE.astype(jnp.float32)
  return jax.nn.softmax(logits_BLE, axis=-1) if kind == "softmax" else jax.nn.sigmoid(logits_BLE)


def select_experts(scores_BLE: jax.Array, bias_E: jax.Array | None, num_selected: int,
                   groups: int = 1, topk_groups: int = 1) -> jax.Array:
  """indices_BLR of the top-R biased scores, restricted to the best `topk_groups` groups.

  A group is scored by the sum of its two best biased scores (DeepSeek-V3; the single
  best when a group holds one expert). Ties go to the lower index (`lax.top_k`).
  """
  E = scores_BLE.shape[-1]
  biased_BLE = scores_BLE
  if bias_E is not None:
    bias_E = bias_E.astype(jnp.float32).reshape((1,) * (scores_BLE.ndim - 1) + (E,))
    biased_BLE = scores_BLE + bias_E
  if groups > 1:
    per_group = E // groups
    grouped = biased_BLE.reshape(*biased_BLE.shape[:-1], groups, per_group)
    group_score = jax.lax.top_k(grouped, min(2, per_group))[0].sum(-1)
    _, best_groups = jax.lax.top_k(group_score, topk_groups)
    keep_group = jax.nn.one_hot(best_groups, groups, dtype=jnp.bool_).any(-2)
    keep_BLE = jnp.repeat(keep_group, per_group, axis=-1)
    biased_BLE = jnp.where(keep_BLE, biased_BLE, -jnp.inf)
  _, indices_BLR = jax.lax.top_k(biased_BLE, num_selected)
  return indices_BLR.astype(jnp.int32)


def route(logits_BLE: jax.Array, bias_E: jax.Array | None, cfg: ModelConfig) -> Routing:
  """Scores, biased selection, unbiased (optionally renormalised, scaled) gates."""
  scores_BLE = scores_of(logits_BLE, cfg.router_score)
  indices_BLR = select_experts(scores_BLE, bias_E, cfg.experts_per_token, cfg.router_groups,
                               cfg.router_topk_groups)
  gates_BLR = jnp.take_along_axis(scores_BLE, indices_BLR, axis=-1)
  if cfg.router_norm_topk:
    gates_BLR = gates_BLR / (gates_BLR.sum(-1, keepdims=True) + 1e-20)
  gates_BLR = gates_BLR * cfg.route_scale
  probs_BLE = scores_BLE / scores_BLE.sum(-1, keepdims=True)  # softmax: unchanged.
  return Routing(indices_BLR, gates_BLR, probs_BLE, logits_BLE.astype(jnp.float32))


# Diagnostics and auxiliary losses ---------------------------------------------------
def expert_counts(indices_BLR: jax.Array, num_experts: int) -> jax.Array:
  """counts_BLE: how many of each token's R choices went to each expert (0 or 1)."""
  return jax.nn.one_hot(indices_BLR, num_experts, dtype=jnp.float32).sum(-2)


def balance_loss(counts_BLE: jax.Array, probs_BLE: jax.Array, per_sequence: bool) -> jax.Array:
  """E * sum_i f_i * P_i with f_i the share of choices and P_i the mean probability.

  Over the whole batch it is the Switch / GShard load-balancing loss; per sequence and
  then averaged it is DeepSeek-V3's sequence-wise balance loss. 1 at perfect balance.
  """
  axes = (1,) if per_sequence else (0, 1)
  return jnp.mean(balance_of(counts_BLE.sum(axes), probs_BLE.mean(axes)))


def balance_of(load_E: jax.Array, mean_prob_E: jax.Array) -> jax.Array:
  """E * sum_i f_i * P_i from the routed pairs per expert (f_i = load_i / sum load) and the
  mean probability P_i; over the last axis. A batch's from its microbatches' summed loads
  and averaged P: how a pipeline (model/pipelined.py) recovers the batch's loss."""
  E = load_E.shape[-1]
  return E * (load_E / load_E.sum(-1, keepdims=True) * mean_prob_E).sum(-1)


def z_loss(logits_BLE: jax.Array) -> jax.Array:
  """ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2."""
  return jnp.mean(jnp.square(jax.nn.logsumexp(logits_BLE.astype(jnp.float32), axis=-1)))


def router_entropy(probs_BLE: jax.Array) -> jax.Array:
  """Mean over tokens of the entropy (nats) of the router distribution: ln E is uniform,
  0 is a router certain of one expert. xlogy: a probability that underflowed to 0 adds 0."""
  return jnp.mean(-xlogy(probs_BLE, probs_BLE).sum(-1))


def weighted_aux_loss(lb: jax.Array, seq: jax.Array, z: jax.Array,
                      cfg: ModelConfig) -> jax.Array:
  """What this layer adds to the training loss. The Switch loss counts only when
  `load_balance == "aux_loss"`; the sequence-wise and z losses whenever their coef > 0."""
  lb_coef = cfg.aux_loss_coef if cfg.load_balance == "aux_loss" else 0.0
  return lb_coef * lb + cfg.seq_aux_loss_coef * seq + cfg.router_z_loss_coef * z


class Router(nn.Module):
  """x_BLD -> Routing; sows loads and unweighted + weighted aux losses into "aux"."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BLD: jax.Array) -> Routing:
    cfg = self.cfg
    E = cfg.num_experts
    chex.assert_rank(x_BLD, 3)
    # float32 end to end: the router is tiny and its decisions are discrete.
    logits_BLE = Einsum((cfg.d_model, E), ("embed", None), dtype="float32",
                        param_dtype=cfg.param_dtype, init_std=cfg.init_std,
                        whole_in_stage=True, name="gate")("BLD,DE->BLE", x_BLD)
    bias_E = None
    if cfg.load_balance == "loss_free":
      # Own collection, float32: never in params, so no gradient or weight decay.
      bias_E = self.variable("moe_state", BIAS, jnp.zeros, (E,), jnp.float32).value
    routing = route(logits_BLE, bias_E, cfg)
    chex.assert_shape(routing.indices_BLR, (*x_BLD.shape[:2], cfg.experts_per_token))

    if not self.is_initializing():  # init would leave stale entries in "aux".
      counts_BLE = expert_counts(routing.indices_BLR, E)
      lb = balance_loss(counts_BLE, routing.probs_BLE, per_sequence=False)
      seq = balance_loss(counts_BLE, routing.probs_BLE, per_sequence=True)
      z = z_loss(routing.logits_BLE)
      self.sow("aux", LOAD, counts_BLE.sum((0, 1)))
      self.sow("aux", MEAN_PROB, routing.probs_BLE.mean((0, 1)))
      self.sow("aux", LB_LOSS, lb)
      self.sow("aux", SEQ_LOSS, seq)
      self.sow("aux", Z_LOSS, z)
      self.sow("aux", AUX_LOSS, weighted_aux_loss(lb, seq, z, cfg))
      self.sow("aux", ENTROPY, router_entropy(routing.probs_BLE))
    return routing

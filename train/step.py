"""The pure train and eval steps: loss, auxiliary losses, metrics.

`train_step(state, batch) -> (state, metrics)` is one optimizer step:
gradient accumulation is a `lax.scan` over micro-batches inside it, so
anything that must happen once per update (the loss-free router-bias
update) happens after the accumulation, never per micro-batch.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax

from model import ModelConfig, Transformer
from model.moe import layer as moe
from model.quantization import quantized
from parallel.pipeline import stage_axis_size
from train import spikes, telemetry
from train.loss import token_losses
from train.optim import learning_rate_schedule
from train.spec.pipeline_checks import ONE_F_ONE_B_SCHEDULES
from train.state import TrainState

Batch = dict[str, jax.Array]


def _apply(model_cfg: ModelConfig, variables, batch: Batch, *, deterministic: bool, rng=None,
           with_telemetry: bool = False, pipeline_microbatches: int = 0,
           pipeline_repeats: int = 1):
  """The forward pass and its vocabulary-tiled head (train/loss.py): TokenLosses, aux and
  (with_telemetry) the sown per-layer telemetry (train/telemetry.py's layer_vectors).
  Under a mesh with a stage axis the layers run as a pipeline of `pipeline_microbatches`
  (0: one per stage; parallel/pipeline.py), round the stages `pipeline_repeats` times (> 1:
  the circular schedule, the stack's rows in its order; parallel/pipeline_circular.py)."""
  rngs = {"dropout": rng} if rng is not None else None
  mutable = ["aux", "telemetry"] if with_telemetry else ["aux"]
  # model.quantization's quantized dots (none: the Transformer itself), here only: what
  # trains and evaluates; init, checkpoints, decoding and export see the plain model.
  hidden_BLD, mutated = quantized(Transformer(model_cfg), model_cfg).apply(
      variables, batch["inputs"], batch["positions"], batch["segment_ids"],
      deterministic=deterministic, rngs=rngs, mutable=mutable, return_hidden=True,
      pipeline_microbatches=pipeline_microbatches, pipeline_repeats=pipeline_repeats)
  losses = token_losses(model_cfg, variables["params"], hidden_BLD, batch["targets"])
  layers = telemetry.layer_vectors(model_cfg, mutated) if with_telemetry else {}
  return losses, mutated.get("aux", {}), layers


def _one_f_one_b(model_cfg: ModelConfig, variables, batch: Batch, rng, denom, z_coef: float,
                 microbatches: int, schedule: tuple[str, int], accum: int):
  """loss_fn's (loss, (ce_sum, aux, stats, layers)) with a 1F1B-family pipeline schedule
  (parallel/pipeline_1f1b.py: 1f1b, 1f1b_lockstep, zero_bubble), which computes each
  microbatch's head and loss inside the schedule, and an MoE's aux losses in its stages:
  the same terms as `_apply` + loss_fn (no telemetry). schedule: (its name, its stash)."""

  def tail(params, h_bLD, extras):
    targets_bL, w_bL, denom_b = extras
    losses = token_losses(model_cfg, params, h_bLD, targets_bL)
    stats = {"ce_sum": jnp.sum(losses.ce_BL * w_bL), **_head_stats(losses, w_bL)}
    loss = (stats["ce_sum"] + z_coef * stats["z_sum"]) / denom_b[0]
    return loss, stats

  B = batch["targets"].shape[0]
  extras_B = (batch["targets"], batch["weights"], jnp.broadcast_to(denom, (B,)))
  (loss, stats_M), mutated = quantized(Transformer(model_cfg), model_cfg).apply(
      variables, batch["inputs"], batch["positions"], batch["segment_ids"],
      deterministic=False, rngs={"dropout": rng}, mutable=["aux"], return_hidden=True,
      pipeline_microbatches=microbatches, pipeline_loss=(tail, extras_B, schedule, 1 / accum))
  stats = {k: (jnp.max if k == "max_logit" else jnp.sum)(v, axis=0) for k, v in stats_M.items()}
  return loss, (stats.pop("ce_sum"), mutated.get("aux", {}), stats, {})


def _head_stats(losses, w_BL: jax.Array) -> dict[str, jax.Array]:
  """Sums over the weighted tokens of what the tiled head already computed (no second
  pass over the logits): log²Z (the z-loss), log Z, the mean logit; and the max logit."""
  return {"z_sum": jnp.sum(jnp.square(losses.logz_BL) * w_BL),
          "logz_sum": jax.lax.stop_gradient(jnp.sum(losses.logz_BL * w_BL)),
          "mean_logit_sum": jnp.sum(losses.mean_logit_BL * w_BL),
          "max_logit": jnp.max(jnp.where(w_BL > 0, losses.max_logit_BL, -jnp.inf))}


def _accumulate(carry, out):
  """Micro-batch sums add; the maxes (output logit, telemetry) are maxes (from -inf)."""
  (loss_c, (ce_c, aux_c, stats_c, layers_c)), grads_c = carry
  (loss_o, (ce_o, aux_o, stats_o, layers_o)), grads_o = out
  add = lambda a, b: jax.tree.map(jnp.add, a, b)
  stats = add(stats_c, stats_o)
  stats["max_logit"] = jnp.maximum(stats_c["max_logit"], stats_o["max_logit"])
  return ((loss_c + loss_o, (ce_c + ce_o, add(aux_c, aux_o), stats,
                             telemetry.combine(layers_c, layers_o))), add(grads_c, grads_o))


def _accumulate_start(grad_fn, state, micro, rng, denom):
  """The accumulation's zeros (-inf for maxes), shaped as one micro-batch's output."""
  zeros = jax.eval_shape(grad_fn, state.params, state.model_state,
                         jax.tree.map(lambda x: x[0], micro), rng, denom)
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), zeros)
  (loss, (ce_sum, aux, stats, layers)), grads = zeros
  stats["max_logit"] = jnp.full((), -jnp.inf, jnp.float32)
  return (loss, (ce_sum, aux, stats, telemetry.empty_like(layers))), grads


def _moe_bias_metrics(model_cfg: ModelConfig, model_state) -> dict:
  """The router biases' summary, and each layer's biases (TensorBoard: a histogram)."""
  biases_YE = moe.router_biases(model_state)
  return {**moe.router_bias_metrics(model_state),
          **{f"moe_bias/layer{model_cfg.first_k_dense + j}": biases_YE[j]
             for j in range(biases_YE.shape[0])}}


def _head_metrics(stats: dict, denom, z_coef: float) -> dict:
  """The z term (when on) and the output-logit telemetry from the tiled head's per-token
  max / mean / log Z."""
  out = {"telemetry/logit_max": stats["max_logit"],
         "telemetry/logit_mean": stats["mean_logit_sum"] / denom,
         "telemetry/logz_mean": stats["logz_sum"] / denom}
  if z_coef:
    out["z_loss"] = z_coef * stats["z_sum"] / denom
  return out


def _telemetry_metrics(model_cfg: ModelConfig, layers, accum: int, aux, params, grads,
                       updates) -> dict:
  """train.telemetry's per-layer figures (train/telemetry.py)."""
  out = telemetry.finish(layers, accum)
  out.update(telemetry.parameter_metrics(model_cfg, params, grads, updates))
  if model_cfg.num_experts:
    out.update(telemetry.moe_telemetry(aux))
  return out


def _spike_guard(train_cfg, state: TrainState, loss, metrics: dict) -> jax.Array:
  """False where train/spikes.py's detector drops the update (on_spike="skip_batch");
  adds `spike` (0 / 1) and `spike_median` to `metrics` when the detector is on."""
  threshold, _, on_spike = spikes.settings(train_cfg)
  if not threshold:
    return jnp.array(True)
  spike, median = spikes.detect(train_cfg, state.recent_loss, state.step, loss)
  metrics.update(spike=spike.astype(jnp.float32), spike_median=median)
  return ~spike if on_spike == "skip_batch" else jnp.array(True)


def _loss_fn(model_cfg: ModelConfig, train_cfg) -> Callable:
  """(params, model_state, batch, rng, denom) -> (loss, (ce_sum, aux, stats, layers)): one
  micro-batch's loss (CE, z-loss and the MoE aux losses) and what the step logs of it."""
  accum = int(train_cfg.grad_accum)
  is_moe = model_cfg.num_experts > 0
  z_coef = float(train_cfg.z_loss)
  with_telemetry = bool(train_cfg.telemetry)  # train/telemetry.py
  microbatches, repeats = int(train_cfg.pipeline_microbatches), int(train_cfg.pipeline_repeats)
  schedule = (train_cfg.pipeline_schedule, int(train_cfg.pipeline_stash))
  one_f_one_b = schedule[0] in ONE_F_ONE_B_SCHEDULES

  def loss_fn(params, model_state, batch, rng, denom):
    if one_f_one_b and stage_axis_size() > 1:
      return _one_f_one_b(model_cfg, {"params": params, **model_state}, batch, rng, denom,
                          z_coef, microbatches, schedule, accum)
    losses, aux, layers = _apply(model_cfg, {"params": params, **model_state}, batch,
                                 deterministic=False, rng=rng, with_telemetry=with_telemetry,
                                 pipeline_microbatches=microbatches, pipeline_repeats=repeats)
    ce_sum = jnp.sum(losses.ce_BL * batch["weights"])
    stats = _head_stats(losses, batch["weights"])
    loss = ce_sum / denom
    if z_coef:
      loss = loss + z_coef * stats["z_sum"] / denom
    if is_moe:
      loss = loss + moe.total_aux_loss(aux) / accum
    return loss, (ce_sum, aux, stats, layers)

  return loss_fn


def make_train_step(model_cfg: ModelConfig, train_cfg,
                    optimizer: optax.GradientTransformation) -> Callable:
  """A non-finite loss or gradient never reaches the parameters: the update is
  skipped and counted; with on_nonfinite="stop" the loop then raises.

  train.z_loss (PaLM's output z-loss, 0: off) adds z_loss * mean(log² Z) over the
  weighted tokens to the loss; the term is logged apart from CE as `z_loss`."""
  schedule = learning_rate_schedule(train_cfg)
  accum = int(train_cfg.grad_accum)
  is_moe = model_cfg.num_experts > 0
  z_coef = float(train_cfg.z_loss)
  with_telemetry = bool(train_cfg.telemetry)  # train/telemetry.py
  grad_fn = jax.value_and_grad(_loss_fn(model_cfg, train_cfg), has_aux=True)

  def train_step(state: TrainState, batch: Batch):
    rng = jax.random.fold_in(state.rng, state.step)
    denom = jnp.maximum(jnp.sum(batch["weights"]), 1.0)
    if accum == 1:
      (loss, (ce_sum, aux, stats, layers)), grads = grad_fn(state.params, state.model_state,
                                                            batch, rng, denom)
    else:
      micro = jax.tree.map(lambda x: x.reshape(accum, x.shape[0] // accum, *x.shape[1:]), batch)

      def body(carry, xs):
        i, mb = xs
        out = grad_fn(state.params, state.model_state, mb, jax.random.fold_in(rng, i), denom)
        return _accumulate(carry, out), None

      zeros = _accumulate_start(grad_fn, state, micro, rng, denom)
      ((loss, (ce_sum, aux, stats, layers)), grads), _ = jax.lax.scan(
          body, zeros, (jnp.arange(accum), micro))
      aux = jax.tree.map(lambda x: x / accum, aux)

    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    model_state = state.model_state
    metrics = {}
    if is_moe:
      model_state = moe.update_moe_state(state.model_state, aux, model_cfg)
      metrics.update(moe.moe_metrics(aux, first_layer=model_cfg.first_k_dense))
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    apply = finite & _spike_guard(train_cfg, state, loss, metrics)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(apply, n, o), new, old)
    params, opt_state, model_state = keep((params, opt_state, model_state),
                                          (state.params, state.opt_state, state.model_state))
    new_state = state.replace(
        step=state.step + 1, params=params, opt_state=opt_state, model_state=model_state,
        skipped_steps=state.skipped_steps + (~finite).astype(jnp.int32),
        first_nonfinite_step=jnp.where((state.first_nonfinite_step < 0) & ~finite,
                                       state.step + 1, state.first_nonfinite_step),
        recent_loss=spikes.remember(state.recent_loss, state.step, loss))
    if is_moe:  # The biases this step leaves behind (unchanged if it was skipped).
      metrics.update(_moe_bias_metrics(model_cfg, model_state))
    metrics.update(
        loss=loss, ce_loss=ce_sum / denom, grad_norm=grad_norm,
        param_norm=optax.tree.norm(params), lr=schedule(state.step),
        tokens=jnp.sum(batch["weights"]), skipped_steps=new_state.skipped_steps)
    metrics.update(_head_metrics(stats, denom, z_coef))
    if with_telemetry:
      metrics.update(_telemetry_metrics(model_cfg, layers, accum, aux, state.params, grads,
                                        updates))
    return new_state, metrics

  return train_step


def make_eval_step(model_cfg: ModelConfig, pipeline_repeats: int = 1) -> Callable:
  """(params, model_state, batch, token_bytes_V) -> summed loss, tokens, bytes, correct.
  pipeline_repeats > 1: the params' stack is in the circular schedule's pipeline order (a
  training state's, train/state.py PipelineOrder); 1: in layer order (a checkpoint's)."""
  is_moe = model_cfg.num_experts > 0

  def eval_step(params, model_state, batch: Batch, token_bytes_V: jax.Array):
    losses, aux, _ = _apply(model_cfg, {"params": params, **model_state}, batch,
                            deterministic=True, pipeline_repeats=pipeline_repeats)
    w_BL = batch["weights"]
    out = {
        "loss_sum": jnp.sum(losses.ce_BL * w_BL),
        "tokens": jnp.sum(w_BL),
        "bytes": jnp.sum(token_bytes_V[batch["targets"]] * w_BL),
        "correct": jnp.sum(losses.correct_BL * w_BL),
    }
    if is_moe:
      out["expert_loads"] = moe.expert_loads(aux)
    return out

  return eval_step


def jit_train_step(model_cfg: ModelConfig, train_cfg, optimizer, state_shardings,
                   batch_sharding):
  """The train step as the trainer runs it: explicit shardings, the state donated."""
  return jax.jit(make_train_step(model_cfg, train_cfg, optimizer), donate_argnums=0,
                 in_shardings=(state_shardings, batch_sharding),
                 out_shardings=(state_shardings, None))


def jit_eval_step(model_cfg: ModelConfig, state_shardings, batch_sharding,
                  pipeline_repeats: int = 1):
  """The eval step as the evaluator runs it: (params, model_state, batch, token_bytes_V)."""
  return jax.jit(make_eval_step(model_cfg, pipeline_repeats),
                 in_shardings=(state_shardings.params, state_shardings.model_state,
                               batch_sharding, None))

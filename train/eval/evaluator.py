"""Evaluation: loss, perplexity, bits per byte and accuracy at several context lengths.

Bits per byte (summed nats / ln 2 / summed UTF-8 bytes of the targets) does
not depend on the tokenizer, so runs with different tokenizers compare.
Metrics at the training length have plain names (`loss`, `bpb`, ...); at
other lengths they carry the length: `loss@256`, `bpb@256`, ...; named evaluation
corpora (train/eval/corpora.py) carry their name: `loss/code`, `bpb/code`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from model import ModelConfig
from model.moe.layer import maxvio
from parallel import batch_sharding, host_local_to_global
from train.eval import tasks
from train.eval.corpora import corpus_batches
from train.optimizers import model_params
from train.step import jit_eval_step


def bits_per_byte(sum_loss_nats: float, sum_bytes: float) -> float:
  """Summed token losses (nats) over the summed UTF-8 bytes of the same targets."""
  if sum_bytes <= 0:
    return float("nan")
  return float(sum_loss_nats) / math.log(2) / float(sum_bytes)


def target_bytes(token_bytes: np.ndarray, batch: dict) -> float:
  """UTF-8 bytes of the weighted targets of a batch: bits_per_byte's denominator."""
  return float(np.sum(token_bytes[batch["targets"]] * batch["weights"]))


def eval_model_config(model_cfg: ModelConfig, eval_cfg, seq_len: int) -> ModelConfig:
  """The model as evaluated: the trained one, or with an eval-only RoPE scaling.

  A zero-shot scaling's original length defaults (eval.rope_original_max_len = 0)
  to the length the model trained at, `seq_len`: resolved here, not in a sweep, so
  a `--config.data.seq_len` override can't leave it at another length.
  """
  overrides = {}
  if eval_cfg.rope_scaling:
    overrides["rope_scaling"] = eval_cfg.rope_scaling
    overrides["rope_original_max_len"] = int(eval_cfg.rope_original_max_len or seq_len)
  if eval_cfg.rope_scaling_factor:
    overrides["rope_scaling_factor"] = float(eval_cfg.rope_scaling_factor)
  elif eval_cfg.rope_original_max_len:
    overrides["rope_original_max_len"] = int(eval_cfg.rope_original_max_len)
  return model_cfg.replace(**overrides) if overrides else model_cfg


class Evaluator:

  def __init__(self, model_cfg: ModelConfig, config, source, mesh, rules, state_shardings,
               pipeline_repeats: int = 1):
    """pipeline_repeats: how the states `run` is given hold their layer stack: R > 1 in the
    circular pipeline's order (the trainer's state, train/state.py PipelineOrder), evaluated
    with that schedule; 1 (a restored checkpoint) in layer order."""
    model_cfg = eval_model_config(model_cfg, config.eval, int(config.data.seq_len))
    self.model_cfg = model_cfg
    self.mesh = mesh
    self.seq_len = int(config.data.seq_len)
    e = config.eval
    self.lengths = sorted({int(m * self.seq_len) for m in e.context_lengths} | {self.seq_len})
    sharding = batch_sharding(mesh, rules)
    self.batches = {
        length: [host_local_to_global(b, mesh, sharding)
                 for b in source.eval_batches(int(e.batch_size), length, int(e.batches))]
        for length in self.lengths}
    self.corpora = {name: [host_local_to_global(b, mesh, sharding) for b in batches]
                    for name, batches in corpus_batches(config, source).items()}
    self.token_bytes = jnp.asarray(source.tokenizer.token_bytes, jnp.float32)
    self.step = jit_eval_step(model_cfg, state_shardings, sharding, pipeline_repeats)
    self.tasks = _TaskRunner(model_cfg, config, source.tokenizer)

  def _totals(self, state, batches) -> dict:
    totals, params = None, model_params(state)
    for batch in batches:
      r = self.step(params, state.model_state, batch, self.token_bytes)
      totals = r if totals is None else jax.tree.map(jnp.add, totals, r)
    return jax.device_get(totals)

  def run(self, state) -> dict:
    out = {}
    for length, batches in self.batches.items():
      totals = self._totals(state, batches)
      metrics = _figures(totals)
      if "expert_loads" in totals:
        metrics["moe_maxvio_global"] = float(maxvio(np.asarray(totals["expert_loads"])))
      suffix = "" if length == self.seq_len else f"@{length}"
      out.update({k + suffix: v for k, v in metrics.items()})
    for name, batches in self.corpora.items():  # eval.corpora, a mixture's domains.
      metrics = _figures(self._totals(state, batches))
      out.update({f"loss/{name}": metrics["loss"], f"bpb/{name}": metrics["bpb"]})
    out.update(self.tasks.run(state))
    return out


class _TaskRunner:
  """eval.tasks (train/eval/tasks.py): names checked when the evaluator is built (an
  unknown one fails before training starts), run at each eval."""

  def __init__(self, model_cfg: ModelConfig, config, tokenizer):
    self.model_cfg, self.eval_cfg, self.tokenizer = model_cfg, config.eval, tokenizer
    self.seq_len = int(config.data.seq_len)
    names = tasks.parse_tasks(config.eval.tasks)
    if names and jax.process_count() > 1:
      raise ValueError(f"eval.tasks={','.join(names)}: tasks are scored on one host; run "
                       "them with --mode eval on a single host (or eval.tasks='' here)")
    self.checked = tasks.check_tasks(names, config.eval.task_dir) if names else None

  def run(self, state) -> dict:
    if self.checked is None:
      return {}
    variables = {"params": model_params(state), **state.model_state}
    return tasks.run_tasks(self.model_cfg, variables, self.tokenizer, self.eval_cfg,
                           self.seq_len, self.checked)


def _figures(totals: dict) -> dict:
  loss = float(totals["loss_sum"]) / max(float(totals["tokens"]), 1.0)
  return {"loss": loss, "ppl": math.exp(min(loss, 50.0)),
          "bpb": bits_per_byte(float(totals["loss_sum"]), float(totals["bytes"])),
          "accuracy": float(totals["correct"]) / max(float(totals["tokens"]), 1.0)}

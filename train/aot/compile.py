"""Compile a run's train, eval and decode steps for a TPU topology that is not attached.

The mesh is the run's (config.mesh) over the topology's compile-only devices (libtpu);
the state's shardings, the batch sharding and the jitted steps are the trainer's own
(train/lifecycle/session.py `layout`, train/step.py `jit_train_step` / `jit_eval_step`,
model/decode/loop.py `prefill` / `decode`), so what compiles here is what a pod runs.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from model import ModelConfig
from model.decode.cache import cache_shapes
from model.decode.loop import decode, prefill
from model.decode.sampling import Sampling
from parallel import mesh_context
from train.aot.topology import Topology
from train.eval.evaluator import eval_model_config
from train.lifecycle import session
from train.loss import chunk_probe
from train.step import jit_eval_step, jit_train_step
from train.spec import RunSpec, parse, read

P = jax.sharding.PartitionSpec
NamedSharding = jax.sharding.NamedSharding


@dataclasses.dataclass
class Compiled:
  """One compiled step: its executable, what it was compiled for, and how long it took.

  XLA:TPU refuses to compile a program whose temporaries exceed the chip's HBM: then
  `executable` is None and `out_of_memory` holds its message."""
  name: str
  executable: Any
  shapes: dict  # What the step was compiled for (batch, length, ...).
  seconds: float
  argument_bytes: int = 0  # Per chip, from the inputs' shardings.
  out_of_memory: str = ""


def validate_for(config, topo: Topology) -> RunSpec:
  """The spec, checked against the topology's chip count; a mesh error names the
  topology."""
  try:
    return parse(config, topo.num_chips)
  except ValueError as e:
    if "mesh" not in str(e):
      raise
    raise ValueError(f"{e}; --topology {topo.describe()} (config.mesh: "
                     f"{dict(config.mesh)})") from None


def _batch(batch: int, length: int, sharding) -> dict:
  ints = jax.ShapeDtypeStruct((batch, length), jnp.int32, sharding=sharding)
  return {"inputs": ints, "targets": ints, "positions": ints, "segment_ids": ints,
          "weights": jax.ShapeDtypeStruct((batch, length), jnp.float32, sharding=sharding)}


def _abstract(template: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda t, s: jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=s),
                      template, shardings)


def _per_chip_bytes(args: Any) -> int:
  """Bytes one chip holds of `args` (abstract arrays with shardings)."""
  total = 0
  for a in jax.tree.leaves(args):
    shape = a.sharding.shard_shape(a.shape) if a.sharding is not None else a.shape
    total += math.prod(shape) * jnp.dtype(a.dtype).itemsize
  return total


def _timed(name: str, lowered, shapes: dict, args: Any) -> Compiled:
  """Compiles `lowered`; `args`: its inputs, abstract with their shardings."""
  t0 = time.perf_counter()
  args = _per_chip_bytes(args)
  try:
    executable, oom = lowered.compile(), ""
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    executable, oom = None, str(e).strip()
  return Compiled(name, executable, shapes, time.perf_counter() - t0, args, oom)


def compile_train(config, lay: session.Session, model_cfg: ModelConfig | None = None) -> Compiled:
  """The train step at data.batch_size x data.seq_len (model_cfg: e.g. another remat)."""
  model_cfg = model_cfg or lay.model_cfg
  d = config.data
  step = jit_train_step(model_cfg, config.train, lay.optimizer, lay.shardings,
                        lay.batch_sharding)
  batch = _batch(int(d.batch_size), int(d.seq_len), lay.batch_sharding)
  lowered = step.lower(lay.template, batch)
  return _timed("train", lowered, {"batch": int(d.batch_size), "length": int(d.seq_len),
                                   "grad_accum": int(config.train.grad_accum),
                                   "remat": model_cfg.remat},
                (_abstract(lay.template, lay.shardings), batch))


def compile_eval(config, lay: session.Session) -> Compiled:
  """The eval step at eval.batch_size x the longest of eval.context_lengths."""
  seq_len = int(config.data.seq_len)
  length = max(int(m * seq_len) for m in (*config.eval.context_lengths, 1))
  eval_cfg = eval_model_config(lay.model_cfg, config.eval, seq_len)
  # As the trainer's in-loop eval runs it: with the train step's schedule (train/loop.py).
  step = jit_eval_step(eval_cfg, lay.shardings, lay.batch_sharding,
                       int(config.train.pipeline_repeats))
  token_bytes_V = jax.ShapeDtypeStruct((lay.model_cfg.vocab_size,), jnp.float32,
                                       sharding=NamedSharding(lay.mesh, P()))
  batch = _batch(int(config.eval.batch_size), length, lay.batch_sharding)
  lowered = step.lower(lay.template.params, lay.template.model_state, batch, token_bytes_V)
  state = _abstract(lay.template, lay.shardings)
  return _timed("eval", lowered, {"batch": int(config.eval.batch_size), "length": length},
                (state.params, state.model_state, batch))


def _batch_axes(lay: session.Session):
  return dict(lay.rules)["batch"]


def compile_decode(config, lay: session.Session) -> Compiled:
  """Prefill and decode (model/decode/loop.py) at eval.batch_size rows: prompts of
  data.seq_len / 2 tokens, then as many new ones, rows split like the train batch.

  Memory is that of `decode` (the cache, donated, plus the weights): prefill's is
  smaller and compiles too (its time is included)."""
  cfg = lay.model_cfg
  B, L = int(config.eval.batch_size), int(config.data.seq_len)
  prompt, new = max(L // 2, 1), max(L - L // 2, 1)
  rows = NamedSharding(lay.mesh, P(_batch_axes(lay)))
  whole = NamedSharding(lay.mesh, P())
  variables = _abstract({"params": lay.template.params, **lay.template.model_state},
                        {"params": lay.shardings.params, **lay.shardings.model_state})
  t0 = time.perf_counter()
  prompts = (jax.ShapeDtypeStruct((B, prompt), jnp.int32, sharding=rows),
             jax.ShapeDtypeStruct((B, prompt), jnp.bool_, sharding=rows))
  first = _timed("decode", prefill.lower(cfg, variables, *prompts, cache_len=prompt + new - 1),
                 {"batch": B, "prompt": prompt, "new_tokens": new}, (variables, *prompts))
  if first.out_of_memory:
    return first
  cache = jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rows if s.ndim else whole),
      cache_shapes(cfg, B, prompt + new - 1))
  scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype, sharding=whole)
  sampling = Sampling(scalar(jnp.float32), scalar(jnp.int32), scalar(jnp.float32))
  key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=whole)
  args = (variables, cache,
          jax.ShapeDtypeStruct((B, cfg.vocab_size), jnp.float32, sharding=rows),
          jax.ShapeDtypeStruct((B,), jnp.int32, sharding=rows), key, sampling,
          scalar(jnp.int32))
  lowered = decode.lower(cfg, *args, max_new_tokens=new)
  out = _timed("decode", lowered, {"batch": B, "prompt": prompt, "new_tokens": new}, args)
  out.seconds = time.perf_counter() - t0
  return out


def layer_period(cfg: ModelConfig) -> tuple[int, int]:
  """(leading layers that differ, period of the layer kinds after them)."""
  period = 1
  for pattern in (cfg.attention_pattern, cfg.rope_pattern):
    period = math.lcm(period, len(pattern) or 1)
  return (cfg.first_k_dense if cfg.num_experts else 0), period


def probe_train_cost(config, lay: session.Session, devices,
                     step_cost: dict[str, float] | None = None) -> dict[str, float] | None:
  """The train step's FLOPs and bytes per chip as XLA counts them, for all its layers.

  XLA's cost analysis counts a `while` body once, so the scanned layer stack would
  count as one layer. Two small unrolled compiles (lead + one period of layer kinds,
  lead + two) give the cost outside the layers and per period; the step's cost is
  extrapolated to model.num_layers from them, with the run's mesh and shardings.
  Unscanned layers with a one-chunk loss need no probe: the compiled step's own cost
  (`step_cost`) counted them all. The scanned step's cost does NOT stand in for the first probe: measured
  on pod.py:preset=1b,smoke at 6 layers on v5e:2x2, its extrapolation came out at 0.94x
  the FLOPs and 0.18x the bytes of the two probes' (the loop's stacked weights and
  gradients are accessed differently from an unrolled layer's).
  The vocabulary-tiled loss's chunk scan is a loop too: a third probe at twice its
  chunks (train/loss.py chunk_probe) gives the per-token cost of a chunk, and n chunks
  cost n times one. FLOPs come out exact (a chunk's are linear in its tokens); bytes
  count the head's per-chunk weight traffic once, not n times (an undercount, small
  beside the step's). None where 2n chunks would exceed the sequence.
  Call it outside a mesh context (each probe lays out its own state)."""
  one_chunk = lay.model_cfg.loss_chunks in (1, "1")  # No loss loop to undercount.
  if step_cost is not None and not lay.model_cfg.scan_layers and one_chunk:
    return dict(step_cost)
  lead, period = layer_period(lay.model_cfg)
  costs, chunks = [], []
  for n in (lead + period, lead + 2 * period):
    c = _probe(config, n, devices, 1, chunks)
    if c is None:
      return None
    costs.append(c)
  periods = (lay.model_cfg.num_layers - lead) / period
  out = {k: costs[0][k] + (periods - 1) * (costs[1][k] - costs[0][k]) for k in costs[0]}
  k = max(chunks, default=1)
  if k > 1:
    if 2 * k > int(config.data.seq_len):
      return None
    doubled = _probe(config, lead + period, devices, 2, [])
    if doubled is None:
      return None
    # Rolled, each probe counts its loss as one chunk: b(T/k) at k chunks, b(T/2k) at
    # 2k; n chunks cost k * b(T/k) = b(T/k) + 2 (k - 1) (b(T/k) - b(T/2k)).
    out = {key: v + 2 * (k - 1) * (costs[0][key] - doubled[key]) for key, v in out.items()}
    out["loss_chunks"] = k
  return out


def _probe(config, num_layers: int, devices, chunk_scale: int, chunks: list[int]
           ) -> dict[str, float] | None:
  """The cost of the train step at `num_layers` unscanned layers (None: out of memory),
  its loss over `chunk_scale` x its chunks; the chunk count it would use goes to
  `chunks`."""
  small = copy.deepcopy(config)
  small.model.update(num_layers=num_layers, scan_layers=False)
  unpipelined(small)  # Unscanned layers are not cut into stages.
  small_spec = read(small)
  small_lay = session.open_run(small_spec, None, "compile", devices)
  with mesh_context(small_lay.mesh, small_lay.rules), chunk_probe(chunk_scale) as seen:
    probe = compile_train(small_spec, small_lay)
  chunks.extend(seen)
  return None if probe.executable is None else cost(probe.executable)


def unpipelined(config) -> None:
  """The stage axes folded into fsdp, in place: the same chips and per-chip work as the
  pipeline's, without its schedule (estimate.py puts the bubble back)."""
  m = config.mesh
  for stage, fsdp in (("stage", "fsdp"), ("dcn_stage", "dcn_fsdp")):
    k = int(m[stage] or 1)
    if k > 1:
      m[stage] = 1
      if int(m[fsdp]) != -1:
        m[fsdp] = int(m[fsdp]) * k
  config.train.pipeline_microbatches = 0


def cost(executable) -> dict[str, float]:
  c = executable.cost_analysis() or {}
  if isinstance(c, list):  # Older jax: one dict per program.
    c = c[0] if c else {}
  return {"flops": float(c.get("flops", 0.0)),
          "bytes_accessed": float(c.get("bytes accessed", 0.0))}


def mesh_sizes(lay: session.Session) -> dict[str, int]:
  return {k: int(v) for k, v in lay.mesh.shape.items()}


def num_params(lay: session.Session) -> int:
  return int(sum(np.prod(x.shape) for x in jax.tree.leaves(lay.template.params)))

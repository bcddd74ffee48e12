"""What every benchmark shares: the configs, the run modes, timing and the jitted train step.

Configs (issue 8): S, M and MoE-S. MoE-S's dense twin with the same active
parameters is S itself: top-2 of experts with hidden 512 is 2 * 512 = 1024 = S's FFN.

Modes scale only the number of timed repetitions ("full", "quick"), except "smoke",
which also shrinks every config to a few seconds of work: it exists so a test can
run the whole harness and check its JSON, not to produce figures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable

import flax.linen as nn
import jax
import numpy as np

from experiments.configs import base
from experiments.configs.sizes import BENCHMARK_SIZES, smoke_fields
from model import ModelConfig
from model.config import MOE_DISPATCH_ALIASES
from parallel import abstract_shardings, batch_sharding, mesh_context, sharded_init
from train.optim import make_optimizer
from train.state import init_state
from train.step import make_train_step

BATCH = 8
# The presets live with the experiments' (one table: experiments/configs/sizes.py).
CONFIGS: dict[str, dict[str, Any]] = dict(BENCHMARK_SIZES)
# Mixtral's routing: softmax top-2, renormalised, Switch aux loss (HF computes it too).
MOE = dict(num_experts=8, experts_per_token=2, expert_mlp_dim=512, load_balance="aux_loss")
CONFIGS["MoE-S"] = {**CONFIGS["S"], **MOE}
# Capacity-style dispatch drops beyond 1.25x the mean load (Switch / GShard's usual
# factor); the dropless paths must run with 0. Keyed by model/moe/dispatch.py's strategy
# names (every one: a renamed strategy must fail here, in the smoke test, not in a run).
CAPACITY_FACTOR = {"auto": 1.25, "capacity_einsum": 1.25, "capacity_gather": 1.25,
                   "dropless": 0.0, "expert_parallel": 1.25, "expert_parallel_ragged": 0.0}
# MoE-S in the throughput table: capacity buffers, factor 1.25 ("auto": one device runs
# them as capacity_gather; moe_dispatch.py times every path).
TRAIN_DISPATCH = "auto"


@dataclasses.dataclass(frozen=True)
class Mode:
  name: str
  warmup: int  # Untimed steps after compilation.
  steps: int  # Timed steps; the figure is their median.
  curve_steps: int  # Length of the float32 / bfloat16 loss curves.

  @property
  def smoke(self) -> bool:
    return self.name == "smoke"


MODES = {
    "full": Mode("full", warmup=2, steps=7, curve_steps=200),
    "quick": Mode("quick", warmup=1, steps=2, curve_steps=20),
    "smoke": Mode("smoke", warmup=1, steps=1, curve_steps=3),
}


def model_config(name: str, mode: Mode, **overrides: Any) -> ModelConfig:
  """The ModelConfig of config `name` ("S", "M", "MoE-S"), shrunk in smoke mode."""
  if name not in CONFIGS:
    raise ValueError(f"config name {name!r}: must be one of {sorted(CONFIGS)}")
  fields = dict(CONFIGS[name])
  if fields.get("num_experts"):
    dispatch = overrides.get("moe_dispatch", TRAIN_DISPATCH)
    dispatch = MOE_DISPATCH_ALIASES.get(dispatch, dispatch)
    if dispatch not in CAPACITY_FACTOR:
      raise ValueError(f"moe_dispatch={dispatch!r}: must be one of {sorted(CAPACITY_FACTOR)}")
    fields.update(moe_dispatch=dispatch, capacity_factor=CAPACITY_FACTOR[dispatch])
  if mode.smoke:  # All experts kept: the expert-parallel benchmarks shard 8 of them.
    fields.update(smoke_fields(fields, max_seq_len=32),
                  vocab_size=min(fields["vocab_size"], 256))
  # Layers unrolled (ModelConfig.scan_unroll): docs/training.md, "On a CPU"; same numbers.
  fields["scan_unroll"] = fields["num_layers"]
  fields.update(overrides)
  return ModelConfig(**fields)


def train_config(steps: int = 10_000):
  """The project's default optimizer section (AdamW, clip 1.0, cosine) for `steps`."""
  t = base.get_config().train
  t.steps = max(int(steps), 1)
  t.warmup_steps = min(t.warmup_steps, max(t.steps // 10, 1))
  return t


def random_batch(cfg: ModelConfig, batch: int = BATCH, seed: int = 0) -> dict[str, np.ndarray]:
  """One packed-format batch of uniform random tokens (speed does not depend on them)."""
  L = cfg.max_seq_len  # Benchmarks run at the config's full length.
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, cfg.vocab_size, (batch, L + 1), dtype=np.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
          "positions": np.broadcast_to(np.arange(L, dtype=np.int32), (batch, L)).copy(),
          "segment_ids": np.ones((batch, L), np.int32),
          "weights": np.ones((batch, L), np.float32)}


@dataclasses.dataclass
class CompiledStep:
  fn: Callable  # (state, batch) -> (state, metrics), compiled, state donated.
  state: Any
  lower_s: float
  compile_s: float
  compiled: Any  # The jax.stages.Compiled, for memory_analysis().
  batch_sharding: Any = None  # Where the batch goes (None: the default device).


def compile_train_step(cfg: ModelConfig, batch: dict, steps: int = 10_000, *, mesh=None,
                       rules=None, init: bool = True, t_cfg=None) -> CompiledStep:
  """The project's jitted train step and a fresh state, compiled ahead of time.

  Without `mesh` everything lives on the default device; with one, the state and
  batch are sharded by the rules table exactly as train/loop.py does. With
  init=False the step is compiled for the state's abstract shapes and `state` is
  None (compile-time and memory figures need no real state). `t_cfg`: the train section
  (default: `train_config(steps)`).
  """
  t_cfg = train_config(steps) if t_cfg is None else t_cfg
  optimizer = make_optimizer(t_cfg, cfg)  # Muon reads the model's matrices.
  init_fn = lambda: init_state(cfg, optimizer, 0, cfg.max_seq_len)
  step = make_train_step(cfg, t_cfg, optimizer)
  ctx, b_sharding, jit_kw, shardings = contextlib.nullcontext(), None, {}, None
  if mesh is not None:
    shardings = abstract_shardings(init_fn, mesh=mesh, rules=rules)[1]
    b_sharding = batch_sharding(mesh, rules)
    ctx = mesh_context(mesh, rules)
    jit_kw = dict(in_shardings=(shardings, b_sharding), out_shardings=(shardings, None))
  if init:
    state, _ = sharded_init(init_fn, mesh=mesh, rules=rules, shardings=shardings)
  else:
    state = nn.unbox(jax.eval_shape(init_fn))
  with ctx:
    jitted = jax.jit(step, donate_argnums=0, **jit_kw)
    t0 = time.perf_counter()
    lowered = jitted.lower(state, batch)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
  return CompiledStep(compiled, state if init else None, t1 - t0, t2 - t1, compiled,
                      b_sharding)


def stepper(step: CompiledStep, batch: dict) -> Callable[[], float]:
  """A call runs one train step (state carried, donated) and blocks; returns the loss."""
  batch = jax.device_put(batch, step.batch_sharding)

  def run() -> float:
    step.state, metrics = step.fn(step.state, batch)
    return float(metrics["loss"])  # Blocks until the step is done.
  return run


def interleaved_times(fns: dict[str, Callable[[], Any]], mode: Mode) -> dict[str, list[float]]:
  """Wall seconds of `mode.steps` calls of each blocking fn, after `mode.warmup` untimed.

  Calls go round-robin (a, b, c, a, b, c, ...), so on a shared machine a burst of
  someone else's load slows every contender alike and the ratios of the medians
  hold even when the absolute times do not.
  """
  times = {k: [] for k in fns}
  for i in range(mode.warmup + mode.steps):
    for name, fn in fns.items():
      t0 = time.perf_counter()
      fn()
      if i >= mode.warmup:
        times[name].append(time.perf_counter() - t0)
  return times


def cpu_snapshot() -> tuple[float, float, float] | None:
  """(wall time, CPU seconds every process on the machine has used: /proc/stat's busy
  jiffies, those of this process and its waited-for children: os.times()); None where
  /proc/stat is missing (not Linux)."""
  import os  # pylint: disable=g-import-not-at-top
  try:
    with open("/proc/stat") as f:
      fields = [int(x) for x in f.readline().split()[1:]]
  except (OSError, ValueError):
    return None
  idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
  busy = (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # Guest time is in user's.
  t = os.times()
  return time.time(), busy, t.user + t.system + t.children_user + t.children_system


def others_cores(start: tuple[float, float, float] | None) -> float | None:
  """Cores the machine's other processes kept busy on average since `start`
  (cpu_snapshot): all CPU time used minus this benchmark's own (and its subprocesses'),
  over the wall time. The load average counts the benchmark's own threads too."""
  end = cpu_snapshot()
  if start is None or end is None or end[0] <= start[0]:
    return None
  return max(0.0, (end[1] - start[1]) - (end[2] - start[2])) / (end[0] - start[0])


def device_info() -> dict[str, Any]:
  import os  # pylint: disable=g-import-not-at-top
  import platform  # pylint: disable=g-import-not-at-top
  cpu = platform.processor()
  try:
    with open("/proc/cpuinfo") as f:
      names = [l.split(":", 1)[1].strip() for l in f if l.startswith("model name")]
    cpu = names[0] if names else cpu
  except OSError:
    pass
  try:
    load = os.getloadavg()[0]
  except OSError:
    load = float("nan")
  return {"backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
          "device_count": jax.device_count(), "cpu": cpu, "cpu_count": os.cpu_count(),
          "load_avg_1min_at_start": load, "jax": jax.__version__,
          "python": platform.python_version()}

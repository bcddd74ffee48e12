"""The pipeline's bubble on the CPU mesh: step time at M = S, 2S, 4S microbatches against
the formula (S - 1) / (M + S - 1), per schedule (GPipe, 1f1b_lockstep: that formula; 1f1b
skips its idle half-ticks, so on this mesh it has none: docs/scaling.md; zero_bubble: its
timetable's 1 - 3M / ticks, which on this mesh it does not pay either); with --repeats,
the circular schedule's at M = S, 2S against (S - 1) / (R M + S - 1).

    python -m benchmarks.pipeline_bubble [--mode quick|full|smoke] [--stages 2,4]
        [--schedules gpipe,1f1b,1f1b_lockstep] [--repeats 2] --out FILE.json

Every stage works in every one of the M + S - 1 ticks of the schedule (on nothing in
S - 1 of them: parallel/pipeline.py), so a pipelined step does (M + S - 1) / M times the
layer work of the same step without a pipeline. On the 8 simulated CPU devices, which share
the host's cores, that extra work costs time just as a stage's idle ticks do on real chips.
The reference is the same train step on a data-only mesh of the same 8 devices (every
device all layers for 1/8 of the rows: no bubble), timed interleaved with the pipelined
ones (common.interleaved_times), each the median of `mode.steps` steps, in `rounds` rounds
whose medians are reported. The measured bubble is 1 - T_reference / T_pipelined.

What else differs from the reference, and so shows up in the measured figure: smaller
matmuls per tick (b = B / M rows split over the data axes), the per-tick ppermute and the
loop's bookkeeping, and the input's gather onto stage 0 and the output's scatter from the
last stage (parallel/pipeline.py stage_map; the head and loss run data-parallel over the
stages, once per row, as in the reference). The model keeps the head small beside the
layers (vocab 256, 8 layers of width 128).

Circular rows (`measure_circular`, train.pipeline_repeats = R; parallel/pipeline_circular.py):
a separate set, timed interleaved with its own reference and GPipe at the same M, so the
two schedules compare within one set. Its steps start from a state in layer order, not the
trainer's pipeline order (the loop's train/state.py PipelineOrder): the same work, other numbers.

The 8 CPU devices are set up here (XLA_FLAGS) before JAX starts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (after XLA_FLAGS)

from benchmarks import common  # noqa: E402
from model import ModelConfig  # noqa: E402
from parallel import logical_rules, make_mesh  # noqa: E402
from parallel.pipeline import bubble_fraction  # noqa: E402
from parallel.pipeline_circular import bubble_fraction as circular_bubble  # noqa: E402
from parallel.pipeline_zero_bubble_plan import bubble_fraction as zero_bubble  # noqa: E402

DEVICES = 8
BATCH = 32  # Divisible by 4S x the data axis (8 / S) for S = 2 and 4.
MODEL = dict(vocab_size=256, d_model=128, num_layers=8, num_heads=4, num_kv_heads=4,
             mlp_dim=512, max_seq_len=64, pos_encoding="rope", scan_unroll=1)
SMOKE = dict(d_model=32, mlp_dim=64, max_seq_len=16)


def _step(cfg: ModelConfig, batch: dict, mesh_cfg: dict, microbatches: int,
          schedule: str = "gpipe", repeats: int = 1):
  """A blocking callable: one train step of the project's step on `mesh_cfg`."""
  mesh = make_mesh(mesh_cfg)
  rules = logical_rules(mesh=mesh, num_kv_heads=cfg.num_kv_heads, num_heads=cfg.num_heads)
  t_cfg = common.train_config()
  t_cfg.update(telemetry=False, pipeline_microbatches=microbatches,
               pipeline_schedule=schedule, pipeline_repeats=repeats)
  step = common.compile_train_step(cfg, batch, mesh=mesh, rules=rules, t_cfg=t_cfg)
  return common.stepper(step, batch), step.compile_s


def measure(stages: int, mode: common.Mode, rounds: int,
            schedules: tuple[str, ...] = ("gpipe",)) -> list[dict]:
  """Rows for M = S, 2S, 4S per schedule: median step seconds, the reference's, measured
  and formula bubble."""
  cfg = ModelConfig(**{**MODEL, **(SMOKE if mode.smoke else {})})
  batch = common.random_batch(cfg, batch=BATCH)
  fns, compile_s = {}, {}
  fns["reference"], compile_s["reference"] = _step(cfg, batch, {"data": DEVICES}, 0)
  counts = (stages, 2 * stages, 4 * stages)
  runs = [(s, M) for M in counts for s in schedules]
  for s, M in runs:
    fns[f"{s} M{M}"], compile_s[f"{s} M{M}"] = _step(
        cfg, batch, {"stage": stages, "data": DEVICES // stages}, M, s)
  medians = _medians(fns, mode, rounds)
  ref = statistics.median(medians["reference"])
  rows = []
  for s, M in runs:
    t = statistics.median(medians[f"{s} M{M}"])
    row = {"schedule": s, "stages": stages, "microbatches": M, "step_s": t,
           "reference_step_s": ref, "round_medians_s": medians[f"{s} M{M}"],
           "reference_round_medians_s": medians["reference"],
           "compile_s": compile_s[f"{s} M{M}"], "measured_bubble": 1 - ref / t,
           "formula_bubble": (zero_bubble if s == "zero_bubble" else bubble_fraction)(
               stages, M)}
    print(f"{s} S={stages} M={M:2d}: step {t:.3f} s (reference {ref:.3f} s); bubble measured "
          f"{row['measured_bubble']:.3f}, formula {row['formula_bubble']:.3f}", flush=True)
    rows.append(row)
  return rows


def _medians(fns: dict, mode: common.Mode, rounds: int) -> dict[str, list[float]]:
  """name -> the median step seconds of each of `rounds` interleaved rounds."""
  medians = {name: [] for name in fns}
  for _ in range(rounds):
    for name, t in common.interleaved_times(fns, mode).items():
      medians[name].append(statistics.median(t))
  return medians


def measure_circular(stages: int, repeats: int, mode: common.Mode, rounds: int) -> list[dict]:
  """Rows for the circular schedule (R = repeats) at M = S, 2S, each beside GPipe at the
  same M, timed in one interleaved set with the data=8 reference."""
  cfg = ModelConfig(**{**MODEL, **(SMOKE if mode.smoke else {})})
  batch = common.random_batch(cfg, batch=BATCH)
  mesh = {"stage": stages, "data": DEVICES // stages}
  fns, compile_s = {}, {}
  fns["reference"], compile_s["reference"] = _step(cfg, batch, {"data": DEVICES}, 0)
  counts = (stages, 2 * stages)
  for M in counts:
    for R in (1, repeats):
      fns[f"M{M}R{R}"], compile_s[f"M{M}R{R}"] = _step(cfg, batch, mesh, M, repeats=R)
  medians = _medians(fns, mode, rounds)
  ref = statistics.median(medians["reference"])
  rows = []
  for M in counts:
    gpipe_t = statistics.median(medians[f"M{M}R1"])
    t = statistics.median(medians[f"M{M}R{repeats}"])
    row = {"stages": stages, "microbatches": M, "repeats": repeats, "step_s": t,
           "gpipe_step_s": gpipe_t, "reference_step_s": ref,
           "round_medians_s": medians[f"M{M}R{repeats}"],
           "gpipe_round_medians_s": medians[f"M{M}R1"],
           "reference_round_medians_s": medians["reference"],
           "compile_s": compile_s[f"M{M}R{repeats}"], "measured_bubble": 1 - ref / t,
           "gpipe_measured_bubble": 1 - ref / gpipe_t,
           "formula_bubble": circular_bubble(stages, M, repeats),
           "gpipe_formula_bubble": bubble_fraction(stages, M)}
    print(f"S={stages} M={M:2d} R={repeats}: step {t:.3f} s (GPipe {gpipe_t:.3f} s, "
          f"reference {ref:.3f} s); bubble measured {row['measured_bubble']:.3f}, formula "
          f"{row['formula_bubble']:.3f} (GPipe {row['gpipe_measured_bubble']:.3f}, "
          f"{row['gpipe_formula_bubble']:.3f})", flush=True)
    rows.append(row)
  return rows


def run(mode: common.Mode, stages: tuple[int, ...], rounds: int,
        schedules: tuple[str, ...] = ("gpipe",), repeats: tuple[int, ...] = ()) -> dict:
  start = common.cpu_snapshot()
  gpipe = not repeats or 1 in repeats  # GPipe's rows at M = S, 2S, 4S.
  rows = [row for S in stages for row in measure(S, mode, rounds, schedules)] if gpipe else []
  circular = [row for S in stages for R in repeats if R > 1
              for row in measure_circular(S, R, mode, rounds)]
  return {"model": MODEL if not mode.smoke else {**MODEL, **SMOKE}, "batch": BATCH,
          "devices": DEVICES, "mode": mode.name, "rounds": rounds, "rows": rows,
          "circular_rows": circular,
          "others_cores": common.others_cores(start), "device": common.device_info()}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--mode", default="quick", choices=sorted(common.MODES))
  parser.add_argument("--stages", default="2,4", help="comma-separated stage counts")
  parser.add_argument("--schedules", default="gpipe,1f1b",
                      help="comma-separated train.pipeline_schedule values")
  parser.add_argument("--repeats", default="",
                      help="comma-separated pipeline_repeats: R > 1 adds circular rows "
                      "(measure_circular); 1 keeps GPipe's; empty: GPipe")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--out", default="", help="write the results as JSON here")
  args = parser.parse_args()
  jax.config.update("jax_enable_compilation_cache", False)
  stages = tuple(int(s) for s in args.stages.split(","))
  repeats = tuple(int(r) for r in args.repeats.split(",") if r)
  results = run(common.MODES[args.mode], stages, args.rounds,
                tuple(args.schedules.split(",")), repeats)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()

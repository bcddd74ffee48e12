"""The pipeline's checks (mesh.stage > 1): what each schedule can run, refused by name
before anything compiles (train/spec/checks.py calls them with its checker `c`;
docs/scaling.md, "Pipeline parallelism", says what is not done)."""

from __future__ import annotations

from model import ModelConfig
from model.transformer import layer_segments

# train.pipeline_schedule (parallel/pipeline*.py; docs/scaling.md, "The 1F1B schedule").
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "1f1b_lockstep", "zero_bubble")
# The schedules that own the loss (parallel/pipeline_1f1b.py `one_f_one_b`).
ONE_F_ONE_B_SCHEDULES = ("1f1b", "1f1b_lockstep", "zero_bubble")


def stages(c, cfg: ModelConfig, sizes: dict, dp: int) -> None:
  """Pipeline parallelism (mesh.stage > 1): what the GPipe schedule can run, refused by name
  (docs/scaling.md, "Pipeline parallelism", says what is not done)."""
  d, t, ev, S = c.config.data, c.config.train, c.config.eval, sizes["stage"]
  why = f"with mesh.stage={S}: "
  if t.pipeline_schedule in ONE_F_ONE_B_SCHEDULES:
    c.need(len(layer_segments(cfg)) == 1, "model.first_k_dense", why + "the 1F1B schedule "
           "computes the loss inside the pipeline after its one scanned segment; a model "
           "of several segments runs train.pipeline_schedule='gpipe'")
    c.need(not cfg.num_experts or cfg.load_balance != "aux_loss", "model.load_balance",
           why + "the Switch balance loss is a product of two means over the whole batch, "
           "known only after every microbatch's forward, but the 1F1B schedule starts "
           "backwards before the last forward; use load_balance='loss_free' (with the "
           "per-microbatch sequence-wise and z losses if wanted) or "
           "train.pipeline_schedule='gpipe'")
    c.need(sizes["context"] == 1, "mesh.context", why + "the 1F1B schedule computes the "
           "loss inside the pipeline on the stack's (zig-zag ordered) tokens, which it "
           "does not reorder; use train.pipeline_schedule='gpipe' with a context axis")
    c.need(int(t.pipeline_repeats) == 1, "train.pipeline_repeats", why + "the 1F1B "
           "schedule runs contiguous stages (train.pipeline_repeats=1); the circular "
           "schedule runs with train.pipeline_schedule='gpipe'")
  c.need(cfg.scan_layers, "model.scan_layers", why + "the pipeline cuts the scanned "
         "layer stack into stages; set model.scan_layers=True")
  c.need(cfg.num_layers % S == 0, "model.num_layers",
         why + f"the layers must divide into {S} equal contiguous stages")
  period = cfg.layer_period
  c.need((cfg.num_layers // period) % S == 0, "model.num_layers",
         why + f"each stage must hold whole periods of the layer patterns (period {period}: "
         f"attention_pattern={cfg.attention_pattern}, rope_pattern={cfg.rope_pattern}), "
         f"so num_layers / {period} must be divisible by {S}")
  if cfg.num_experts:
    moe(c, cfg, sizes)
  c.need(not t.telemetry, "train.telemetry", why + "per-layer telemetry is sown inside the "
         "layer scan, which the pipeline does not carry out of its stages; set "
         "train.telemetry=False")
  c.need(not ev.tasks, "eval.tasks", why + "task evaluation (train/eval/) feeds batches "
         "the pipeline's microbatches do not divide; evaluate with --mode eval on a mesh "
         "without stages")
  M = int(t.pipeline_microbatches) or S
  micro = d.batch_size // t.grad_accum
  c.need(micro % (M * dp) == 0, "data.batch_size",
         f"the micro-batch {micro} (batch_size / grad_accum) must be divisible by "
         f"train.pipeline_microbatches ({M}) x the data-parallel size data*fsdp*expert "
         f"({dp}) = {M * dp}: each pipeline microbatch is split over the data axes")
  # Refused, not run with the head replicated over the stages: the rules table (one per
  # mesh, parallel/rules.py) splits every batch over the stages, the input's too.
  c.need(micro % (S * dp) == 0, "data.batch_size",
         f"the micro-batch {micro} (batch_size / grad_accum) must be divisible by "
         f"mesh.stage x data*fsdp*expert = {S * dp}: outside the pipeline (embedding, "
         "final norm, head, loss) the rows are split over the stages too")
  c.need(ev.batch_size % (S * dp) == 0, "eval.batch_size",
         f"must be divisible by mesh.stage x data*fsdp*expert = {S * dp}: evaluation "
         "runs the pipeline with one microbatch per stage")


def circular(c, cfg: ModelConfig, sizes: dict) -> None:
  """The circular schedule (train.pipeline_repeats = R > 1), refused by name where it
  cannot run (docs/scaling.md, "The circular schedule (`train.pipeline_repeats`)")."""
  t, R, S = c.config.train, int(c.config.train.pipeline_repeats), sizes["stage"]
  if R == 1:
    return
  why = f"with mesh.stage={S} and train.pipeline_repeats={R}: "
  period = cfg.layer_period
  c.need((cfg.num_layers // period) % (S * R) == 0, "model.num_layers",
         why + f"the stack is cut into stages x repeats = {S * R} chunks of whole periods "
         f"of the layer patterns (period {period}), so num_layers / {period} must be "
         f"divisible by {S * R}")
  k = cfg.first_k_dense if cfg.num_experts else 0
  if 0 < k < cfg.num_layers:
    c.need((k // period) % (S * R) == 0, "model.first_k_dense",
           why + f"the {k} dense layers and the {cfg.num_layers - k} MoE layers are two "
           f"circular pipelines, each cut into stages x repeats = {S * R} chunks of whole "
           f"periods (period {period}), so first_k_dense / {period} must be divisible by "
           f"{S * R}")
  c.need(t.optimizer != "kron", "train.optimizer", why + "kron keeps its per-layer "
         "preconditioners of a stack replicated, not split over the stages like the layers, so "
         "the trainer's pipeline row order (train/state.py PipelineOrder) would miss them; "
         "use another optimizer or train.pipeline_repeats=1")
  M = int(t.pipeline_microbatches) or S
  c.need(M % S == 0, "train.pipeline_microbatches",
         why + f"the circular schedule sends groups of {S} microbatches (one per stage) "
         f"round the ring, each arriving back at stage 0 as its next repeat starts there, "
         f"so the microbatches ({M}) must be a multiple of mesh.stage ({S})")


def moe(c, cfg: ModelConfig, sizes: dict) -> None:
  """An MoE in pipeline stages: each segment is its own pipeline over all the stages."""
  S, k, period = sizes["stage"], cfg.first_k_dense, cfg.layer_period
  why = f"with mesh.stage={S}: "
  if 0 < k < cfg.num_layers:
    c.need((k // period) % S == 0, "model.first_k_dense",
           why + f"the {k} dense layers and the {cfg.num_layers - k} MoE layers are two "
           f"pipelines over all {S} stages, so each must cut into {S} stages of whole "
           f"periods (period {period}): first_k_dense / {period} must be divisible by {S}")
  c.need(cfg.moe_dispatch not in ("expert_parallel", "expert_parallel_ragged")
         or sizes["expert"] == 1, "model.moe_dispatch",
         why + "expert-parallel dispatch's shard_map does not nest in the pipeline's (the "
         "expert weights' cotangents lose the stage axis); use 'auto' or 'capacity_einsum', "
         "whose expert einsums GSPMD splits over mesh.expert inside each stage")

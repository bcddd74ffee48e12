"""The run spec's sections: every field of config.data / train / eval / mesh / hardware,
with its type, its default (what experiments/configs/base.py starts from) and what it
means. The model section is `ModelConfig` itself (model/config.py).

One home for the schema: base.py builds the user-facing ConfigDict from these defaults
(`defaults`), train/spec/parse.py reads a ConfigDict or an older run's config.json into
these frozen dataclasses, and the code reads fields as attributes, never with a default
of its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class DataSpec:
  """config.data: corpus, tokenizer, batch shape, validation split, MQAR task."""
  # "shakespeare" | dir or glob of .txt | *.bin tokens | "mqar" | a prepared dataset
  # (`--mode prepare`'s output: a directory, or a gs:// / s3:// URL) | "mixture".
  corpus: str = "shakespeare"
  # Named prepared datasets, "web=prepared/web,code=gs://bucket/code": what data.mixture
  # (and eval.corpora) name.
  datasets: str = ""
  # corpus="mixture": weights over data.datasets, "web:0.7,code:0.3" (any positive scale).
  mixture: str = ""
  # What data.mixture's weights count: "tokens" (rows of seq_len tokens) or "bytes" (each
  # domain's text, through its prepared bytes per token: tokenizers differ by domain).
  mixture_unit: str = "tokens"
  token_dtype: str = "uint16"  # For pre-tokenized .bin corpora.
  # "byte" | "sentencepiece" | "hf:PATH" (a tokenizer.json) | "hf" (the run's own copy).
  tokenizer: str = "byte"
  vocab_size: int = 256  # SentencePiece vocab size (byte: fixed 256).
  spm_model: str = ""  # Given SentencePiece model file; "": train one (.bin corpora need one).
  seq_len: int = 128
  batch_size: int = 32  # Global batch (all hosts, all micro-batches of one step).
  num_val_works: int = 4  # Shakespeare: whole works held out for validation.
  val_fraction: float = 0.05  # Other text corpora: fraction of files (or tokens) held out.
  # Text corpora: skip files that are not UTF-8 (counted and named in the log and in
  # config.json's _run.data.skipped_documents) instead of refusing the corpus.
  skip_undecodable: bool = False
  shuffle_buffer: int = 0  # 0: global shuffle of windows (deterministic given seed).
  worker_count: int = 0  # grain worker processes (0: in-process).
  # TEST-ONLY fault injection (train/data/poison.py): (first, count) train batches, by
  # their position in the data stream, whose targets all become the last token id. ()
  # is off; never set it in an experiment.
  test_poison: tuple = ()
  # corpus="mqar" (train/data/mqar.py): synthetic recall; needs seq_len + 1 >= 4 * num_kv_pairs.
  mqar_num_kv_pairs: int = 8  # Key-value bindings per sequence, each queried once.
  mqar_vocab: int = 256  # Keys from the lower half, values from the upper half.
  mqar_power_a: float = 0.01  # Query-gap power law (Zoology's default: mostly short gaps).
  # Passkey samples (train/data/passkey.py) mixed into a text corpus: this fraction of the
  # training rows is replaced by a passkey sample of seq_len + 1 tokens (0: none).
  passkey_fraction: float = 0.0
  passkey_needles: int = 1  # Needles per mixed-in sample (one is asked for).


@dataclasses.dataclass(frozen=True)
class TrainSpec:
  """config.train: optimisation, logging, checkpointing, failure handling, profiling."""
  steps: int = 600
  seed: int = 0
  lr: float = 3e-3
  schedule: str = "cosine"  # "cosine" | "linear" | "constant" | "wsd" (warmup-stable-decay)
  warmup_steps: int = 50
  min_lr_ratio: float = 0.1
  # wsd: the cooldown's share of train.steps and its shape, "linear" or "sqrt" (1 - sqrt).
  decay_fraction: float = 0.2
  decay_shape: str = "linear"
  # "adamw" | "adafactor" | "lion" | "muon" | "schedule_free_adamw" | "kron" (train/optimizers.py,
  # docs/training.md "Optimizers"); each takes lr, the schedule, weight_decay and its mask.
  optimizer: str = "adamw"
  b1: float = 0.9  # AdamW's (and schedule-free's, Lion's) first-moment decay.
  b2: float = 0.95
  muon_momentum: float = 0.95  # Muon's Nesterov momentum (its AdamW part takes b1 / b2).
  lion_b2: float = 0.99  # Lion's momentum decay (train.b1: its interpolation).
  eps: float = 1e-8
  weight_decay: float = 0.1
  decay_norms: bool = False  # Weight decay on norm scales.
  decay_biases: bool = False
  decay_embeddings: bool = False
  grad_clip: float = 1.0  # Global-norm clip; 0: off.
  grad_accum: int = 1  # Micro-batches per optimizer step.
  # With mesh.stage > 1: microbatches of each (grad_accum) micro-batch fed through the
  # pipeline's stages (GPipe; bubble (S-1)/(M+S-1)); 0: as many as stages.
  pipeline_microbatches: int = 0
  # The pipeline's schedule (docs/scaling.md): "gpipe" (all forwards, then all backwards:
  # M microbatches' activations per stage), "1f1b" (each backward as soon as its loss
  # exists: at most min(M, S); half-ticks of one forward or one backward),
  # "1f1b_lockstep" (a forward and a backward every tick: fewer ticks, min(M, 2S - 1)) or
  # "zero_bubble" (the backward split into input and weight gradients, the weight
  # gradients deferred into the bubble; at most min(M, S); docs/scaling.md).
  pipeline_schedule: str = "gpipe"
  # zero_bubble only: the microbatches whose weight gradients a stage may hold back at once
  # (each holds their inputs and output cotangents); 0: as many as stages. Fewer: less
  # memory, more ticks (docs/scaling.md, "The zero-bubble schedule").
  pipeline_stash: int = 0
  # With mesh.stage > 1: times each microbatch goes round the stages (the circular
  # schedule, bubble (S-1)/(R*M+S-1); parallel/pipeline_circular.py); 1: GPipe.
  pipeline_repeats: int = 1
  # PaLM's output z-loss: + z_loss * mean(log² Z) (PaLM used 1e-4); 0: off.
  z_loss: float = 0.0
  # Per-layer stability telemetry in every step (train/telemetry.py, docs/stability.md).
  telemetry: bool = True
  log_every: int = 20
  eval_every: int = 200
  checkpoint_every: int = 200
  keep_checkpoints: int = 3  # Keep the last N...
  keep_every: int = 0  # ...plus every K-th step (0: none)...
  keep_steps: tuple = ()  # ...plus these (decay branches start there).
  async_checkpoint: bool = True
  # The local tier (train/local_checkpoint.py): also save every local_checkpoint_every steps
  # (0: off) on the host's disk, in local_checkpoint_dir ("": $TMPDIR/blockwork-local/<digest
  # of the run directory>); a resume takes the newest of both tiers. One process only.
  local_checkpoint_every: int = 0
  local_checkpoint_dir: str = ""
  # RUN/LOCK's lease (train/lifecycle/lock.py; docs/scaling.md, "The LOCK's lease"): the
  # holder renews it every lock_lease_s / 4 s from a thread; a LOCK not renewed for
  # lock_lease_s seconds is stale and taken over (a pod restarted on new hosts waits at
  # most this long).
  lock_lease_s: float = 120.0
  on_nonfinite: str = "stop"  # "stop" | "skip" (skip the update, count it)
  # Loss spikes (train/spikes.py, docs/stability.md): a step whose loss exceeds
  # spike_threshold x the median of the spike_window steps before it (0: off);
  # on_spike "none" (log it) | "skip_batch" (drop its update) | "rollback" (restore the last
  # checkpoint, skip the data since it).
  spike_threshold: float = 1.5
  spike_window: int = 50
  on_spike: str = "none"
  tensorboard: bool = True
  # Weights & Biases project ("": off); needs `pip install -e .[wandb]`. WANDB_MODE=offline
  # logs into RUN/wandb/ without network. A resume continues the same W&B run.
  wandb_project: str = ""
  # jax.profiler trace of profile_steps steps (0: off) from step profile_start (0: the
  # first step after compilation) into RUN/profile/ (TensorBoard's profile plugin, Perfetto).
  profile_steps: int = 0
  profile_start: int = 0


@dataclasses.dataclass(frozen=True)
class EvalSpec:
  """config.eval: batches, context lengths, zero-shot RoPE scaling, extra corpora, tasks."""
  batches: int = 8  # Batches per eval (at each context length).
  batch_size: int = 16
  context_lengths: tuple = (1,)  # Multiples of data.seq_len (e.g. (1, 2, 4)).
  at_start: bool = False  # Also evaluate the untrained model (step 0): eval curves from step 0.
  # Zero-shot context extension: evaluate with a RoPE scaling the model was not
  # trained with ("" / 0: the model's own). Train at L, evaluate at 2L, 4L, ...
  rope_scaling: str = ""
  rope_scaling_factor: float = 0.0
  rope_original_max_len: int = 0  # With eval.rope_scaling, 0: the training length L.
  # Named evaluation corpora, "docs=prepared/docs,stdlib=src/*.txt" (prepared datasets:
  # their validation split; text files: all of it), each evaluated apart at every eval
  # as loss/<name>, bpb/<name>. A mixture's domains are always evaluated so too.
  corpora: str = ""
  # Tasks beyond the loss, at every eval (docs/evaluation.md): "passkey", "multi_needle"
  # and any lm-evaluation-harness task or group (needs the `eval` extra), e.g.
  # "hellaswag,arc_easy"; "": none.
  tasks: str = ""
  task_dir: str = ""  # A directory of harness task YAMLs (local JSONL data works offline).
  num_fewshot: int = -1  # Harness few-shot examples; -1: each task's own default.
  task_limit: int = 0  # Harness examples per task (0: all); for a quick look, not a paper.
  task_batch_size: int = 16  # Rows per forward pass of the task scorer.
  retrieval_lengths: tuple = (1, 2, 4, 8)  # Multiples of data.seq_len (tokens, key included).
  retrieval_depths: tuple = (0.0, 0.25, 0.5, 0.75, 1.0)  # Where the asked-for needle sits.
  retrieval_samples: int = 4  # Samples per (length, depth) cell.
  retrieval_needles: int = 4  # multi_needle: needles per sample (one is asked for).
  retrieval_candidates: int = 10  # Keys ranked by log-likelihood: the true one + others.


@dataclasses.dataclass(frozen=True)
class MeshSpec:
  """config.mesh: device mesh axis sizes (docs/scaling.md, "The mesh")."""
  # Pipeline stages: the layer stack cut into this many contiguous stages (docs/scaling.md,
  # "Pipeline parallelism"); train.pipeline_microbatches sets the schedule's microbatches.
  stage: int = 1
  data: int = -1  # -1: all remaining devices.
  fsdp: int = 1
  # Context parallelism: the sequence split over this many devices, attention by ring
  # (docs/scaling.md, "Context parallelism"); data.seq_len must divide by 2 * context.
  context: int = 1
  tensor: int = 1
  expert: int = 1
  dcn_stage: int = 1  # Multi-slice (DCN) sizes; 1 on one slice / one host.
  dcn_data: int = 1
  dcn_fsdp: int = 1
  dcn_context: int = 1
  dcn_tensor: int = 1
  dcn_expert: int = 1

  def sizes(self) -> dict[str, int]:
    """The axis sizes as parallel.make_mesh / mesh_shape take them."""
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class HardwareSpec:
  peak_flops: float = 0.0  # Per device; 0: measure a jitted matmul at startup.


SECTIONS = {"data": DataSpec, "train": TrainSpec, "eval": EvalSpec, "mesh": MeshSpec,
            "hardware": HardwareSpec}

# What a field absent from an older run's config.json meant when that run trained (the
# feature was off), where that differs from today's default above. Every other absent
# field takes its default.
ABSENT: dict[tuple[str, str], Any] = {
    ("train", "telemetry"): False,
    ("train", "spike_threshold"): 0.0,
    ("train", "spike_window"): 1,
}

EVAL_TASK_FIELDS = ("tasks", "task_dir", "num_fewshot", "task_limit", "task_batch_size",
                    "retrieval_lengths", "retrieval_depths", "retrieval_samples",
                    "retrieval_needles", "retrieval_candidates")


def defaults(section: str) -> dict[str, Any]:
  """A section's fields at their defaults, in declaration order (base.py's ConfigDict)."""
  return {f.name: f.default for f in dataclasses.fields(SECTIONS[section])}

"""The attention implementation table, "auto", and the one place a layer picks its entry.

The score computation is chosen once from `cfg.attention_impl` through IMPLS:
"xla" (the reference, model/attention/reference.py), "blockwise" (flash attention in
pure JAX, model/attention/blockwise.py), "cudnn" and "splash" (model/attention/kernels.py), "ring" (context parallelism,
model/attention/ring.py); "auto" is settled by `resolve_attention_impl`. `layer_impl` is what GQA and MLA layers
call: it adds decoding (always the reference) and the init-time swap to blockwise.
"""

from __future__ import annotations


from model import backend as target
from model.attention import kernels as attention_kernels, scores
from model.attention.blockwise import blockwise_attention
from model.attention.reference import AttendFn, xla_attention
from model.attention.ring import ring_attention
from model.attention.scores import spec_from_config
from model.config import ModelConfig
from parallel.context import context_axis_size
from parallel.pipeline import stage_axis_size

IMPLS: dict[str, AttendFn] = {
    "xla": xla_attention,
    "blockwise": blockwise_attention,
    "cudnn": attention_kernels.cudnn_attention,
    "splash": attention_kernels.splash_attention,
    "ring": ring_attention,
}
VENDOR_KERNELS = ("cudnn", "splash")  # Each runs on one backend only.
# Initialised as "blockwise" (init needs shapes only): the kernels run on one backend, the
# ring under a context mesh and on lengths divisible by 2 * context (init's may not be).
INIT_AS_BLOCKWISE = (*VENDOR_KERNELS, "ring")
# What a mesh with context > 1 can run: only the ring keeps the sequence split.
CONTEXT_PARALLEL_IMPLS = ("auto", "ring")
# Queries from which "auto" runs blockwise rather than the reference. CPU is measured
# (docs/PERFORMANCE.md, "Attention implementations": blockwise is no slower from one
# 256-block up and far faster from two); GPU / TPU fall back to it only where their
# kernel cannot serve the config, and keep the reference up to where its [L, S]
# scores start to cost memory, unmeasured.
BLOCKWISE_MIN_LEN = {"cpu": 512, "gpu": 2048, "tpu": 2048}
# The implementations that report their largest attention logit (train.telemetry): the
# reference reduces its score matrix, blockwise keeps its rows' running max. The vendor
# kernels (cuDNN, Splash) return only the output and the ring only its blocks' merge:
# their layers report no `attn_logit_max` (docs/stability.md, "Telemetry").
REPORTS_MAX_LOGIT = ("xla", "blockwise")


def resolve_attention_impl(cfg: ModelConfig, backend: str, seq_len: int,
                           context: int | None = None) -> str:
  """The implementation `cfg.attention_impl` runs for `seq_len` queries on `backend`.

  Under a mesh whose "context" axis has more than one device (`context`, default: the
  context mesh's), "auto" is "ring" and every other explicit choice is refused (it would
  gather the whole sequence on every device).
  Explicit choices are returned as they are; "auto" picks the fastest that serves
  the config: TPU -> Splash (under a mesh, shard_mapped over the batch and KV-head
  axes; not inside pipeline stages), GPU (bfloat16, no soft-cap, no ALiBi) -> cuDNN, else blockwise from
  BLOCKWISE_MIN_LEN[backend] queries and the reference below. Decoding always runs "xla".
  """
  if (c := context_axis_size() if context is None else context) > 1:
    if cfg.attention_impl not in CONTEXT_PARALLEL_IMPLS:
      raise ValueError(f"attention_impl={cfg.attention_impl!r} attends over the whole "
                       f"sequence, but the mesh splits it over context={c} devices: use "
                       f"one of {CONTEXT_PARALLEL_IMPLS} (ring attention), or mesh.context=1")
    return "ring"
  # Inside a pipeline stage (parallel/pipeline.py's shard_map over "stage"), Splash's own
  # shard_map does not nest: its cotangents lose the stage axis's type (XLA:TPU compile
  # error "Expected cotangent type ... {V:stage}"). "auto" then runs blockwise / the reference.
  stages = stage_axis_size()
  if cfg.attention_impl == "splash" and stages > 1:
    raise ValueError(f"attention_impl='splash' cannot run inside pipeline stages "
                     f"(mesh.stage={stages}): its shard_map does not nest in the pipeline's; "
                     "use 'auto' (blockwise or xla inside stages) or 'xla'")
  if cfg.attention_impl != "auto":
    return cfg.attention_impl
  if backend == "tpu" and stages == 1 and not attention_kernels.unsupported("splash", cfg):
    return "splash"
  # cuDNN would take a score bias (ALiBi) as a dense [B, N, L, S] array: blockwise computes
  # it per block.
  if (backend == "gpu" and not scores.active_biases(spec_from_config(cfg)) and
      not attention_kernels.unsupported("cudnn", cfg)):
    return "cudnn"
  return "blockwise" if seq_len >= BLOCKWISE_MIN_LEN.get(backend, 2048) else "xla"


def layer_impl(cfg: ModelConfig, seq_len: int, *, decode: bool, initializing: bool,
               with_max: bool = False) -> AttendFn:
  """The IMPLS entry an attention layer runs for `seq_len` queries.

  Decoding attends from a cache offset, which only the reference serves. Init needs only
  shapes, and blockwise runs anywhere in linear memory: a GPU / TPU config initialises
  (and restores, through eval_shape of init) on any host.

  with_max: the function returns (out, max logit), the max None where the implementation
  cannot report it (not in REPORTS_MAX_LOGIT).
  """
  impl = "xla" if decode else resolve_attention_impl(cfg, target.backend(), seq_len)
  if initializing and impl in INIT_AS_BLOCKWISE:
    impl = "blockwise"
  fn = IMPLS[impl]
  if not with_max:
    return fn
  if impl in REPORTS_MAX_LOGIT:
    return lambda *args: fn(*args, return_max=True)
  return lambda *args: (fn(*args), None)

"""ModelConfig: the frozen, hashable description of one Transformer.

Modules take this (static) config and nothing else; the experiment ConfigDict
stops at the trainer. `validate()` runs in `__post_init__`, so an invalid
config fails where it is built, with a ValueError naming the field.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from model import mup, quantization, remat as remat_lib

POS_ENCODINGS = ("rope", "sinusoidal", "learned", "alibi", "none")
ROPE_LAYOUTS = ("split_half", "interleaved")
ROPE_SCALINGS = ("none", "linear", "ntk", "dynamic_ntk", "yarn", "llama3")
NORMS = ("rmsnorm", "layernorm")
NORM_POSITIONS = ("pre", "post")
FFN_TYPES = ("swiglu", "geglu", "gelu", "relu")
REMAT_POLICIES = remat_lib.NAMES  # model/remat.py: MaxText's names, and save_dots.
DTYPES = ("float32", "bfloat16")
ROUTER_SCORES = ("softmax", "sigmoid")
LOAD_BALANCES = ("none", "aux_loss", "loss_free")
ATTENTION_IMPLS = ("auto", "xla", "blockwise", "cudnn", "splash", "ring")
MOE_DISPATCHES = ("auto", "capacity_einsum", "capacity_gather", "dropless", "expert_parallel",
                  "expert_parallel_ragged")  # model/moe/dispatch.py: one function each.
# Names a run may have been configured with before the strategies were named for what they
# do (issue 26): "capacity" was "auto" under another name. Accepted and mapped, so old
# configs and runs resume (train/lifecycle/changes.py compares the mapped values).
MOE_DISPATCH_ALIASES = {"capacity": "auto"}
ATTENTION_TYPES = ("gqa", "mla")  # GQA (MHA / MQA included) or multi-head latent attention.
ATTENTION_KINDS = ("local", "global")  # attention_pattern entries.
ROPE_KINDS = ("rope", "nope")  # rope_pattern entries.
PATTERN_FIELDS = ("attention_pattern", "rope_pattern")


class MLADims(NamedTuple):
  """Multi-head latent attention sizes (legend letters of model/attention/mla.py in brackets)."""
  q_lora_rank: int  # [Q] 0: full-rank queries.
  kv_lora_rank: int  # [A] the cached, normalised KV latent.
  qk_nope_head_dim: int  # [H] per-head query / key dims without position.
  qk_rope_head_dim: int  # [P] rotated dims: per-head queries, one key shared by all heads.
  v_head_dim: int  # [U]


class LayerKind(NamedTuple):
  """What varies per layer (static: each kind is its own traced block)."""
  window: int  # Sliding window of the layer's attention; 0: full causal.
  rope: bool  # The layer rotates q and k (pos_encoding="rope" and not a NoPE layer).


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Every architectural choice of a decoder-only Transformer."""

  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  mlp_dim: int
  max_seq_len: int
  head_dim: int | None = None  # None: d_model // num_heads.

  # Positional encoding.
  pos_encoding: str = "rope"
  rope_theta: float = 10_000.0
  rope_fraction: float = 1.0  # Fraction of head_dim that is rotated (partial RoPE).
  rope_layout: str = "split_half"  # GPT-NeoX / Llama; "interleaved": RoFormer / GPT-J.
  rope_scaling: str = "none"
  rope_scaling_factor: float = 1.0
  rope_original_max_len: int | None = None  # Pre-extension context; None: max_seq_len.
  yarn_beta_fast: float = 32.0
  yarn_beta_slow: float = 1.0
  yarn_attn_factor: float | None = None  # None: 0.1 * ln(factor) + 1 (YaRN paper).
  llama3_low_freq_factor: float = 1.0
  llama3_high_freq_factor: float = 4.0
  # Which layers rotate, repeated over depth: e.g. ("rope",) * 3 + ("nope",) is Llama 4's
  # NoPE layer every 4th layer. (): every layer rotates.
  rope_pattern: tuple[str, ...] = ()

  # Attention.
  attn_scale: float | None = None  # None: 1 / sqrt(head_dim).
  qk_norm: bool = False
  sliding_window: int = 0  # 0: full causal attention.
  # Layer kinds repeated over depth, e.g. ("local",) * 5 + ("global",) (Gemma 3):
  # sliding_window applies to "local" layers only. (): it applies to every layer.
  attention_pattern: tuple[str, ...] = ()
  attn_logit_softcap: float = 0.0  # 0: off; else cap * tanh(logits / cap).
  attn_bias: bool = False  # Bias on the q/k/v projections (Qwen2).
  # "auto": model/attention/impls.py resolve_attention_impl (backend and length); decoding: "xla".
  # "ring": context parallelism (model/attention/ring.py), what "auto" runs under a mesh
  # with mesh.context > 1; on one device it is blockwise's math with a ring of one.
  attention_impl: str = "auto"
  # Query / key block lengths of "blockwise" and "ring"; 0: from the score rows B*K*G (CPU-tuned,
  # model/attention/blockwise.py auto_block: 256 to 64; the ring also caps it by its local
  # queries, model/attention/ring.py ring_block; docs/PERFORMANCE.md, "Attention implementations").
  attention_block_q: int = 0
  attention_block_kv: int = 0
  # Multi-head latent attention (DeepSeek-V2/V3, model/attention/mla.py): K and V are up-projected
  # per head from a normalised kv_lora_rank latent, beside one rope key shared by all heads;
  # the decode cache holds only those. 0 in a dim: DeepSeek-V2's ratios to head_dim
  # (kv_lora_rank 4H, qk_rope_head_dim H/2, qk_nope_head_dim H, v_head_dim H).
  attention_type: str = "gqa"
  q_lora_rank: int = 0  # 0: full-rank queries; else queries from a normalised latent.
  kv_lora_rank: int = 0
  qk_nope_head_dim: int = 0
  qk_rope_head_dim: int = 0
  v_head_dim: int = 0
  # DeepSeek's YaRN: the softmax scale times (0.1 * m * ln(factor) + 1)**2; 0: off.
  yarn_mscale_all_dim: float = 0.0

  # Block.
  norm: str = "rmsnorm"
  norm_eps: float = 1e-6
  norm_position: str = "pre"
  ffn: str = "swiglu"
  tie_embeddings: bool = False
  dropout_rate: float = 0.0  # Residual dropout, on each sub-layer output.
  embed_dropout_rate: float = 0.0
  init_std: float = 0.02
  # µP (model/mup.py) relative to this base width; 0: the standard parametrisation.
  mup_base_width: int = 0

  # Stack and precision.
  scan_layers: bool = True
  # Layers per iteration of each scanned segment; >= its depth unrolls it completely:
  # the same parameters and numbers, no loop. On CPU a fully unrolled stack trains
  # faster (no stacked residual buffers to zero, fill and slice each step) and compiles
  # slower as depth grows (docs/PERFORMANCE.md, "Second round").
  scan_unroll: int = 1
  remat: str = "none"
  # remat="custom" only: "tensor=remat|device|offload,..." over model/remat.py TENSORS.
  remat_custom: str = ""
  # Token chunks of the output head + cross-entropy (train/loss.py): the [B, L, V] logits
  # never exist, only one chunk's [B, L / loss_chunks, V] at a time (forward and backward).
  # An int >= 1, or "auto": sized from the vocabulary and the tokens per chip to about
  # 256 MiB of float32 logits per chunk. The same numbers for any chunking (each token's
  # loss is computed alone), so a resume may change it (train/lifecycle/changes.py).
  loss_chunks: int | str = "auto"
  dtype: str = "float32"  # Compute dtype.
  param_dtype: str = "float32"
  # Quantized training (model/quantization.py, through Qwix): "none", "int8", "fp8",
  # "int8_weight". The router and the head stay in the compute dtype unless quantize_head.
  quantization: str = "none"
  quantize_head: bool = False

  # Mixture-of-Experts (num_experts == 0: dense FFN everywhere).
  num_experts: int = 0
  experts_per_token: int = 2
  expert_mlp_dim: int | None = None  # None: mlp_dim.
  num_shared_experts: int = 0
  first_k_dense: int = 0  # The first k layers keep a dense FFN.
  router_score: str = "softmax"
  router_norm_topk: bool = True  # Renormalise gate weights over the chosen experts.
  route_scale: float = 1.0
  router_groups: int = 1  # Group-limited routing: experts split into groups...
  router_topk_groups: int = 1  # ...of which the best `router_topk_groups` are eligible.
  load_balance: str = "none"
  bias_update_rate: float = 1e-3  # u of loss-free balancing.
  aux_loss_coef: float = 1e-2  # Switch/GShard load-balancing loss.
  seq_aux_loss_coef: float = 0.0  # DeepSeek-V3 sequence-wise balance loss.
  router_z_loss_coef: float = 0.0  # ST-MoE router z-loss.
  capacity_factor: float = 0.0  # 0: dropless.
  eval_capacity_factor: float | None = None  # None: same as capacity_factor.
  moe_dispatch: str = "auto"  # "capacity" (its old name) is accepted: MOE_DISPATCH_ALIASES.

  def __post_init__(self):
    # JSON (config.json) and ConfigDicts give lists: a tuple keeps the config hashable.
    for f in PATTERN_FIELDS:
      if isinstance(getattr(self, f), list):
        object.__setattr__(self, f, tuple(getattr(self, f)))
    if isinstance(self.loss_chunks, str) and self.loss_chunks.strip().isdigit():
      # A command-line override of the "auto" default arrives as a string.
      object.__setattr__(self, "loss_chunks", int(self.loss_chunks))
    dispatch = MOE_DISPATCH_ALIASES.get(self.moe_dispatch, self.moe_dispatch)
    object.__setattr__(self, "moe_dispatch", dispatch)
    self.validate()
    mup.validate(self)
    quantization.validate(self)

  # Derived quantities ------------------------------------------------------
  @property
  def resolved_head_dim(self) -> int:
    return self.head_dim if self.head_dim is not None else self.d_model // self.num_heads

  @property
  def num_groups(self) -> int:
    """G: query heads per KV head."""
    return self.num_heads // self.num_kv_heads

  @property
  def layers_looped(self) -> bool:
    """One layer period per loop iteration: scanned and not unrolled. Remat saves
    memory only then (model/transformer.py, train/spec/checks.py)."""
    return self.scan_layers and self.scan_unroll == 1

  @property
  def resolved_expert_mlp_dim(self) -> int:
    return self.expert_mlp_dim if self.expert_mlp_dim is not None else self.mlp_dim

  @property
  def mla_dims(self) -> "MLADims":
    """The resolved MLA dims (0 fields -> DeepSeek-V2's ratios to head_dim)."""
    H = self.resolved_head_dim
    return MLADims(self.q_lora_rank, self.kv_lora_rank or 4 * H, self.qk_nope_head_dim or H,
                   self.qk_rope_head_dim or 2 * max(1, H // 4), self.v_head_dim or H)

  @property
  def rope_original_len(self) -> int:
    return self.rope_original_max_len or self.max_seq_len

  def is_moe_layer(self, layer: int) -> bool:
    return self.num_experts > 0 and layer >= self.first_k_dense

  def layer_kind(self, layer: int) -> LayerKind:
    """Layer `layer`'s window and RoPE choice, from the patterns."""
    window = self.sliding_window
    if self.attention_pattern:
      kind = self.attention_pattern[layer % len(self.attention_pattern)]
      window = self.sliding_window if kind == "local" else 0
    rope = self.pos_encoding == "rope" and (
        not self.rope_pattern or self.rope_pattern[layer % len(self.rope_pattern)] == "rope")
    return LayerKind(window, rope)

  @property
  def layer_period(self) -> int:
    """Smallest p dividing num_layers with layer_kind(i) == layer_kind(i % p): the layers
    one scanned body holds (1 without patterns, or with patterns of one effective kind)."""
    kinds = [self.layer_kind(i) for i in range(self.num_layers)]
    return next(p for p in range(1, self.num_layers + 1) if self.num_layers % p == 0
                and all(kinds[i] == kinds[i % p] for i in range(self.num_layers)))

  def replace(self, **kwargs: Any) -> "ModelConfig":
    return dataclasses.replace(self, **kwargs)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
      raise ValueError(f"ModelConfig: unknown field(s) {unknown}")
    return cls(**d)

  # Validation --------------------------------------------------------------
  def validate(self) -> None:
    def need(cond: bool, field: str, msg: str):
      if not cond:
        raise ValueError(f"ModelConfig.{field}={getattr(self, field)!r}: {msg}")

    def choice(field: str, allowed: tuple[str, ...]):
      need(getattr(self, field) in allowed, field, f"must be one of {allowed}")

    for f in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads",
              "mlp_dim", "max_seq_len"):
      need(isinstance(getattr(self, f), int) and getattr(self, f) > 0, f,
           "must be a positive integer")
    need(self.num_heads % self.num_kv_heads == 0, "num_kv_heads",
         f"must divide num_heads={self.num_heads} (1 = MQA, num_heads = MHA, "
         f"allowed: {[k for k in range(1, self.num_heads + 1) if self.num_heads % k == 0]})")
    if self.head_dim is None:
      need(self.d_model % self.num_heads == 0, "num_heads",
           f"must divide d_model={self.d_model} when head_dim is None")
    else:
      need(self.head_dim > 0, "head_dim", "must be positive")
    choice("pos_encoding", POS_ENCODINGS)
    choice("rope_layout", ROPE_LAYOUTS)
    choice("rope_scaling", ROPE_SCALINGS)
    choice("norm", NORMS)
    choice("norm_position", NORM_POSITIONS)
    choice("ffn", FFN_TYPES)
    self._validate_remat(need, choice)
    n = self.loss_chunks
    need(n == "auto" or (type(n) is int and n >= 1), "loss_chunks",  # pylint: disable=unidiomatic-typecheck
         'must be "auto" or an integer >= 1 (token chunks of the output head and loss)')
    need(self.scan_unroll >= 1, "scan_unroll", "must be >= 1 (layers per loop iteration)")
    choice("dtype", DTYPES)
    choice("param_dtype", DTYPES)
    choice("router_score", ROUTER_SCORES)
    choice("load_balance", LOAD_BALANCES)
    choice("moe_dispatch", MOE_DISPATCHES)
    choice("attention_impl", ATTENTION_IMPLS)
    self._validate_mla(need, choice)
    for f in ("attention_block_q", "attention_block_kv"):
      need(isinstance(getattr(self, f), int) and getattr(self, f) >= 0, f,
           "must be a positive integer, or 0 (sized from the batch and heads)")
    self._validate_kernel(need)
    need(0.0 < self.rope_fraction <= 1.0, "rope_fraction", "must be in (0, 1]")
    rotary = int(self.resolved_head_dim * self.rope_fraction)
    need(rotary % 2 == 0 and rotary > 0, "rope_fraction",
         f"head_dim * rope_fraction = {rotary} rotated dims must be a positive even number")
    need(self.rope_theta > 0, "rope_theta", "must be positive")
    need(self.rope_scaling_factor >= 1.0 or self.rope_scaling == "none",
         "rope_scaling_factor", "must be >= 1 for a context-extension scaling")
    need(self.sliding_window >= 0, "sliding_window", "must be >= 0 (0 = off)")
    self._validate_patterns(need)
    need(self.attn_logit_softcap >= 0, "attn_logit_softcap", "must be >= 0 (0 = off)")
    need(0.0 <= self.dropout_rate < 1.0, "dropout_rate", "must be in [0, 1)")
    need(0.0 <= self.embed_dropout_rate < 1.0, "embed_dropout_rate", "must be in [0, 1)")
    need(self.num_experts >= 0, "num_experts", "must be >= 0 (0 = dense FFN)")
    if self.num_experts > 0:
      need(1 <= self.experts_per_token <= self.num_experts, "experts_per_token",
           f"must be in [1, num_experts={self.num_experts}]")
      need(self.num_experts % self.router_groups == 0, "router_groups",
           f"must divide num_experts={self.num_experts}")
      need(1 <= self.router_topk_groups <= self.router_groups, "router_topk_groups",
           f"must be in [1, router_groups={self.router_groups}]")
      need(self.experts_per_token <= self.router_topk_groups *
           (self.num_experts // self.router_groups), "experts_per_token",
           "must not exceed the experts in the eligible groups")
      need(0 <= self.first_k_dense <= self.num_layers, "first_k_dense",
           f"must be in [0, num_layers={self.num_layers}]")
      need(self.capacity_factor >= 0, "capacity_factor", "must be >= 0 (0 = dropless)")
      need(self.num_shared_experts >= 0, "num_shared_experts", "must be >= 0")
      need(self.eval_capacity_factor is None or self.eval_capacity_factor >= 0,
           "eval_capacity_factor", "must be None (= capacity_factor) or >= 0 (0 = no drops)")
      if self.moe_dispatch in ("dropless", "expert_parallel_ragged"):
        need(self.capacity_factor == 0, "capacity_factor",
             f"must be 0 with moe_dispatch={self.moe_dispatch!r} (it never drops)")
        need(self.eval_capacity_factor in (None, 0), "eval_capacity_factor",
             f"must be None or 0 with moe_dispatch={self.moe_dispatch!r} (it never drops)")
      need(self.route_scale > 0, "route_scale", "must be positive")
      need(self.bias_update_rate >= 0, "bias_update_rate", "must be >= 0")
      for f in ("aux_loss_coef", "seq_aux_loss_coef", "router_z_loss_coef"):
        need(getattr(self, f) >= 0, f, "must be >= 0")

  def _validate_kernel(self, need) -> None:
    """A vendor kernel's static gaps fail here; its backend is checked when the model runs."""
    if self.attention_impl in ("cudnn", "splash"):
      # Imported here: model.attention imports this module.
      from model.attention.kernels import unsupported  # pylint: disable=g-import-not-at-top
      reasons = unsupported(self.attention_impl, self)
      need(not reasons, "attention_impl", "; ".join(reasons))

  def _validate_remat(self, need, choice) -> None:
    choice("remat", REMAT_POLICIES)
    if self.remat != "custom":
      need(not self.remat_custom, "remat_custom", f"is read only with remat='custom' "
           f"(remat={self.remat!r})")
      return
    need(bool(self.remat_custom.strip()), "remat_custom", "remat='custom' needs the map: "
         f"tensor=remat|device|offload,... over {', '.join(remat_lib.TENSORS)}")
    try:
      remat_lib.parse_custom(self.remat_custom)
    except ValueError as e:
      need(False, "remat_custom", str(e))

  def _validate_mla(self, need, choice) -> None:
    choice("attention_type", ATTENTION_TYPES)
    need(not self.yarn_mscale_all_dim or self.attention_type == "mla", "yarn_mscale_all_dim",
         "only MLA (DeepSeek) scales its softmax by YaRN's mscale_all_dim")
    if self.attention_type != "mla":
      return
    for f in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
              "v_head_dim"):
      need(isinstance(getattr(self, f), int) and getattr(self, f) >= 0, f,
           "must be an integer >= 0 (0: the default, see ModelConfig)")
    need(self.num_kv_heads == self.num_heads, "num_kv_heads",
         f"must equal num_heads={self.num_heads} with attention_type='mla': every head "
         "up-projects its own key and value from the shared latent")
    need(self.mla_dims.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", "must be even")
    need(self.rope_fraction == 1.0, "rope_fraction",
         "MLA rotates exactly its qk_rope_head_dim dims (set those instead)")
    need(self.pos_encoding in ("rope", "none"), "pos_encoding",
         "MLA rotates its decoupled rope dims ('rope') or nothing ('none')")
    need(not self.sliding_window, "sliding_window",
         "attention_type='mla' has no sliding-window (ring-buffer) cache")
    need(not self.qk_norm, "qk_norm", "attention_type='mla' normalises the latents instead")
    need(not self.attn_bias, "attn_bias", "attention_type='mla' has no projection biases")
    need(self.yarn_mscale_all_dim >= 0, "yarn_mscale_all_dim", "must be >= 0 (0 = off)")

  def _validate_patterns(self, need) -> None:
    for f, kinds in (("attention_pattern", ATTENTION_KINDS), ("rope_pattern", ROPE_KINDS)):
      pattern = getattr(self, f)
      need(isinstance(pattern, tuple) and all(isinstance(k, str) for k in pattern), f,
           f"must be a tuple of {kinds} entries, e.g. {(kinds[0], kinds[1])}")
      need(all(k in kinds for k in pattern), f, f"entries must be in {kinds}")
      need(not pattern or self.num_layers % len(pattern) == 0, f,
           f"its length {len(pattern)} must divide num_layers={self.num_layers} (the pattern "
           "repeats over depth)")
    need("local" not in self.attention_pattern or self.sliding_window > 0, "attention_pattern",
         f"a 'local' layer needs sliding_window > 0 (sliding_window={self.sliding_window})")
    need(not self.rope_pattern or self.pos_encoding == "rope", "rope_pattern",
         f"needs pos_encoding='rope' (pos_encoding={self.pos_encoding!r})")
    if self.num_experts and 0 < self.first_k_dense < self.num_layers:
      # Each segment (dense, MoE) is scanned over whole periods of the patterns.
      need(self.first_k_dense % self.layer_period == 0, "first_k_dense",
           f"must be a multiple of the layer patterns' period {self.layer_period} "
           f"(attention_pattern={self.attention_pattern}, rope_pattern={self.rope_pattern})")

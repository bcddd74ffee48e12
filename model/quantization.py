"""Quantized training (`ModelConfig.quantization`) through Qwix's QT provider.

`quantized(module, cfg)` returns the module with Qwix's interception around its methods
(`qwix.quantize_model`): inside it, each `jnp.einsum` / `lax.dot_general` / `lax.ragged_dot`
whose Flax module path matches a rule below runs as Qwix's quantized dot with a custom
VJP (forward operands quantized with per-channel absmax scales, one scale per
non-contracted index; the incoming gradient quantized in the backward pass). Nothing is
added to the variables: checkpoints hold the full-precision master weights, and the
quantization happens anew from them in every step (dynamic scaling).

Which dots are quantized, by module path:
- every projection, i.e. every `layers.Einsum` named in PROJECTIONS (attention q/k/v/o,
  MLA's, the dense FFN's and the MoE shared experts' wi/wg/wo);
- the routed experts' matmuls: the `lax.dot_general` / `lax.ragged_dot` calls of the MoE
  layer (model/moe/dispatch.py `expert_ffn`, grouped.py); its one-hot dispatch and combine
  einsums are `jnp.einsum` and stay as they are;
- the vocabulary head (`embedder`, `unembed`) only with `quantize_head`.
The router (`router/gate`) and attention's score / value einsums (not projections: both
operands are activations) match no rule and run in the compute dtype.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import flax.linen as nn
import jax.numpy as jnp
import qwix
# Qwix's hook for model code, "the current rule if intercepted, else None" (its providers
# intercept it like the dots); not re-exported by qwix 0.1.8's top level.
from qwix._src import qconfig as qwix_qconfig

# Every `Einsum` name that is a projection (model/attention/gqa.py, mla.py, layers.py).
# tests/model/test_quantization.py checks that each Einsum module of the models there is
# either one of these, the router's gate or the head: a new projection must be added here.
PROJECTIONS = ("q", "k", "v", "o", "wi", "wg", "wo", "q_a", "q_nope", "q_rope", "kv_a",
               "k_rope", "k_up", "v_up")
MOE_SLOT = "ffn"  # model/block.py's Block: the FFN slot, dense or MoE.
HEAD = r"embedder(/unembed)?|unembed|"  # Under Transformer; Embedder alone (train/loss.py).


class Scheme(NamedTuple):
  """QtRule's dtypes: weights and activations in the forward pass, the incoming gradient
  in the backward pass (None: not quantized)."""
  weight: object
  act: object
  bwd: object


# ModelConfig.quantization -> its scheme. "int8": MaxText's (int8 forward and backward,
# int8 x int8 -> int32 dots). "fp8": e4m3 forward, e5m2 gradients (the usual float8
# training recipe). "int8_weight": weight-only, dequantized before a floating-point dot
# (the weights' rounding in the loss, no low-precision matmul).
SCHEMES: dict[str, Scheme | None] = {
    "none": None,
    "int8": Scheme(jnp.int8, jnp.int8, jnp.int8),
    "fp8": Scheme(jnp.float8_e4m3fn, jnp.float8_e4m3fn, jnp.float8_e5m2),
    "int8_weight": Scheme(jnp.int8, None, None),
}
QUANTIZATIONS = tuple(SCHEMES)
# Dispatches whose expert weights reach the dot as model parameters Qwix can recognise.
# Elsewhere (gathered per block, or inside expert parallelism's shard_map) they look like
# activations: int8 / fp8 quantize both operands alike, so only weight-only needs them.
WEIGHT_ONLY_DISPATCHES = ("capacity_einsum", "capacity_gather")


def validate(cfg) -> None:
  """ValueError naming the field where quantization does not apply (ModelConfig calls it)."""
  def need(cond: bool, field: str, msg: str):
    if not cond:
      raise ValueError(f"ModelConfig.{field}={getattr(cfg, field)!r}: {msg}")
  need(cfg.quantization in SCHEMES, "quantization", f"must be one of {QUANTIZATIONS}")
  need(not cfg.quantize_head or cfg.quantization != "none", "quantize_head",
       "quantizes the head with model.quantization's scheme; it is 'none'")
  if cfg.quantization == "int8_weight" and cfg.num_experts:
    need(cfg.moe_dispatch in WEIGHT_ONLY_DISPATCHES, "moe_dispatch",
         f"must be one of {WEIGHT_ONLY_DISPATCHES} with quantization='int8_weight': "
         "elsewhere the expert weights reach the matmul gathered or inside expert "
         "parallelism's shard_map, where Qwix cannot tell them from activations")


def _rule(scheme: Scheme, module_path: str, op_names: Sequence[str] = ()) -> qwix.QtRule:
  return qwix.QtRule(module_path=module_path, op_names=tuple(op_names),
                     weight_qtype=scheme.weight, act_qtype=scheme.act, bwd_qtype=scheme.bwd)


def rules(cfg) -> list[qwix.QtRule]:
  """The QtRules of cfg, first match wins (Qwix matches module paths in full)."""
  scheme = SCHEMES[cfg.quantization]
  if scheme is None:
    return []
  out = [_rule(scheme, rf"(.*/)?({'|'.join(PROJECTIONS)})"),
         _rule(scheme, rf"(.*/)?{MOE_SLOT}", ("dot_general", "ragged_dot"))]
  if cfg.quantize_head:
    out.append(_rule(scheme, f"({HEAD})"))
  return out


def quantizes_here(op_name: str) -> bool:
  """Whether the running quantized call would quantize an `op_name` ("ragged_dot", ...)
  issued here: model code that could take a kernel Qwix cannot see into (a Pallas call)
  asks, and takes the plain op instead."""
  return qwix_qconfig.get_current_rule(op_name) is not None


def quantized(module: nn.Module, cfg, methods: Sequence[str] = ("__call__",)) -> nn.Module:
  """`module` with cfg's quantized dots in `methods` (itself when quantization='none')."""
  if SCHEMES[cfg.quantization] is None:
    return module
  return qwix.quantize_model(module, qwix.QtProvider(rules(cfg)), methods=tuple(methods))

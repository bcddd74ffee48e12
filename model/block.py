"""One Transformer layer (`Block`: attention + FFN/MoE, residuals, norms), one period of
the layer patterns (`Period`) and the scanned stack of them (`scanned`), which
model/transformer.py runs per segment and model/pipelined.py per pipeline stage."""

from __future__ import annotations

import flax.linen as nn
from jax.ad_checkpoint import checkpoint_name

from model import remat, telemetry
from model.attention.gqa import Attention
from model.attention.mla import MLA
from model.config import LayerKind, ModelConfig
from model.layers import FeedForward, make_norm
from model.moe.layer import MoE
from parallel.context import context_axis_size


# Collections whose variables are per layer (stacked on axis 0 when scanned).
LAYER_COLLECTIONS = ("params", "cache", "aux", "moe_state", telemetry.COLLECTION)


def ffn_module(cfg: ModelConfig, is_moe: bool, name: str) -> nn.Module:
  """The FFN slot of a block: the dense FFN or the MoE layer, chosen once."""
  if is_moe:
    return MoE(cfg, name=name)
  return FeedForward(cfg, name=name)


def attention_module(cfg: ModelConfig, kind: LayerKind | None, name: str) -> nn.Module:
  """The attention slot of a block: GQA (model/attention/gqa.py) or MLA (model/attention/mla.py)."""
  if cfg.attention_type == "mla":
    return MLA(cfg, kind, name=name)
  return Attention(cfg, kind, name=name)


def residual_names(cfg: ModelConfig) -> tuple[str, str, str]:
  """The residual stream's logical names between layers: its D split over tensor
  ("residual", parallel/rules.py), except where the vocabulary does not divide over the
  tensor axis (the run spec refuses that; the Python API allows it): there XLA:CPU
  computed wrong activations with the split residual on a (data, fsdp, tensor) mesh
  (tests/train/test_loss.py::test_sharded_over_fsdp_and_tensor_equals_one_device)."""
  even = cfg.vocab_size % context_axis_size("tensor") == 0
  return ("batch", "length", "residual" if even else "embed")


class Block(nn.Module):
  """One pre-norm or post-norm ("Add & Norm") Transformer layer."""

  cfg: ModelConfig
  is_moe: bool = False
  kind: LayerKind | None = None  # None: layer 0's (the whole stack's, without patterns).

  @nn.compact
  def __call__(self, x_BLD, positions_BL, segment_ids_BL, deterministic: bool = True,
               decode: bool = False):
    cfg = self.cfg
    x_BLD = checkpoint_name(x_BLD, "decoder_layer_input")
    attn = attention_module(cfg, self.kind, "attn")
    ffn = ffn_module(cfg, self.is_moe, "ffn")
    drop = nn.Dropout(cfg.dropout_rate, broadcast_dims=())
    norm1, norm2 = make_norm(cfg, "norm1"), make_norm(cfg, "norm2")
    pre = cfg.norm_position == "pre"
    update_BLD = drop(attn(norm1(x_BLD) if pre else x_BLD, positions_BL, segment_ids_BL,
                           decode), deterministic=deterministic)
    x_BLD = x_BLD + update_BLD if pre else norm1(x_BLD + update_BLD)
    ffn_BLD = drop(ffn(norm2(x_BLD) if pre else x_BLD, deterministic=deterministic),
                   deterministic=deterministic)
    x_BLD = x_BLD + ffn_BLD if pre else norm2(x_BLD + ffn_BLD)
    x_BLD = nn.with_logical_constraint(x_BLD, residual_names(cfg))
    if telemetry.enabled(self):  # Each block's updates and the residual stream it leaves.
      telemetry.sow(self, "attn_update_ms", telemetry.mean_square(update_BLD))
      telemetry.sow(self, "ffn_update_ms", telemetry.mean_square(ffn_BLD))
      telemetry.sow(self, "residual_ms", telemetry.mean_square(x_BLD))
    return x_BLD, None


def block_class(cfg: ModelConfig):
  if cfg.remat == "none":
    return Block
  # static_argnums count `self` as 0: deterministic is 4, decode is 5. Inside a loop of
  # one layer per iteration CSE cannot merge the recomputation with the forward pass;
  # unrolled (scan_unroll > 1, or no scan) it would, keeping every activation alive.
  return nn.remat(Block, policy=remat.policy(cfg.remat, cfg.remat_custom),
                  prevent_cse=not cfg.layers_looped, static_argnums=(4, 5))


class Period(nn.Module):
  """One period of the layer patterns: a block per kind, the body of a scanned segment."""

  cfg: ModelConfig
  is_moe: bool
  kinds: tuple[LayerKind, ...]

  @nn.compact
  def __call__(self, x_BLD, positions_BL, segment_ids_BL, deterministic: bool = True,
               decode: bool = False):
    block_cls = block_class(self.cfg)
    for j, kind in enumerate(self.kinds):
      x_BLD, _ = block_cls(self.cfg, self.is_moe, kind, name=f"block_{j}")(
          x_BLD, positions_BL, segment_ids_BL, deterministic, decode)
    return x_BLD, None


def scanned(cfg: ModelConfig, is_moe: bool, kinds: tuple[LayerKind, ...], n: int):
  """The scanned body over n layers (n / M periods of the patterns' M kinds) and its args."""
  M = len(kinds)
  body, args = (block_class(cfg), (is_moe, kinds[0])) if M == 1 else (Period, (is_moe, kinds))
  stack = nn.scan(
      body, variable_axes={c: 0 for c in LAYER_COLLECTIONS},
      split_rngs={"params": True, "dropout": True}, in_axes=(nn.broadcast,) * 4,
      length=n // M, unroll=min(cfg.scan_unroll, n // M),
      metadata_params={nn.PARTITION_NAME: "layers"})
  return stack, args

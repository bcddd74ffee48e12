"""Collective bytes read from a compiled HLO module: ops in a loop count once per trip."""

import pytest

from train.aot.hlo import collective_bytes, dcn_collectives, matmul_ops

# The shape of XLA:TPU's text: a scanned layer loop (trip count in its condition) holding
# an all-gather of a [256, 64] bf16 weight over 4 devices; after it, an all-reduce of a
# f32[1024] gradient over 8 devices (mesh spelling), an async all-to-all over 2.
HLO = """HloModule jit_train_step, entry_computation_layout={()->f32[]}

%cond.1 (p: (s32[], bf16[64,64])) -> pred[] {
  %p = (s32[], bf16[64,64]{1,0}) parameter(0)
  %gte = s32[] get-tuple-element(%p), index=0
  %constant.7 = s32[] constant(12)
  ROOT %lt = pred[] compare(%gte, %constant.7), direction=LT
}

%body.1 (p: (s32[], bf16[64,64])) -> (s32[], bf16[64,64]) {
  %p = (s32[], bf16[64,64]{1,0}) parameter(0)
  %w = bf16[64,64]{1,0} get-tuple-element(%p), index=1
  %all-gather.3 = bf16[256,64]{1,0:T(8,128)(2,1)} all-gather(%w), channel_id=3, replica_groups=[2,4]<=[8], dimensions={0}
  ROOT %t = (s32[], bf16[64,64]{1,0}) tuple(%gte, %w)
}

ENTRY %main.9_spmd (a: f32[1024]) -> f32[] {
  %a = f32[1024]{0} parameter(0)
  %while.5 = (s32[], bf16[64,64]{1,0}) while(%init), condition=%cond.1, body=%body.1
  %all-reduce.16 = f32[1024]{0:T(1024)} all-reduce(%a), channel_id=17, replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0','axis_1'}, to_apply=%add
  %all-to-all-start.2 = (f32[16,8]{1,0}, f32[16,8]{1,0}) all-to-all-start(%x), replica_groups={{0,1},{2,3}}
  ROOT %r = f32[] constant(0)
}
"""


def test_loop_trips_group_sizes_and_wire_bytes():
  got = collective_bytes(HLO)
  gather = 256 * 64 * 2
  assert got["all-gather"]["count"] == 12
  assert got["all-gather"]["bytes"] == 12 * gather
  assert got["all-gather"]["wire_bytes"] == pytest.approx(12 * gather * 3 / 4)
  assert got["all-reduce"] == {"count": 1, "bytes": 4096.0, "wire_bytes": 2 * 4096 * 7 / 8}
  assert got["all-to-all"]["bytes"] == 16 * 8 * 4  # The start's result, not operand + result.
  assert got["all-to-all"]["wire_bytes"] == 16 * 8 * 4 / 2
  assert got["total"]["count"] == 14


# Two slices: a permute across them in a 3-trip loop (XLA:TPU's send to the Megascale
# runtime, its recv beside it), one all-reduce across them after it; the in-slice
# all-gather is on the chips' interconnect and not counted as crossing.
DCN_HLO = """HloModule jit_train_step, entry_computation_layout={()->f32[]}

%cond.2 (p: (s32[], bf16[2,8])) -> pred[] {
  %p = (s32[], bf16[2,8]{1,0}) parameter(0)
  %gte = s32[] get-tuple-element(%p), index=0
  %constant.3 = s32[] constant(3)
  ROOT %lt = pred[] compare(%gte, %constant.3), direction=LT
}

%body.2 (p: (s32[], bf16[2,8])) -> (s32[], bf16[2,8]) {
  %p = (s32[], bf16[2,8]{1,0}) parameter(0)
  %x = bf16[2,8]{1,0} get-tuple-element(%p), index=1
  %send.10 = (bf16[2,8]{1,0:T(8,128)(2,1)}, u32[], token[]) send(%x, %after-all.10), channel_id=2, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_host_transfer_rendezvous="ppermute.31_0",_xla_megascale_target={{100000->200000}},_xla_megascale_transfer_type="ONE_TO_ONE"}
  %recv.10 = (bf16[2,8]{1,0:T(8,128)(2,1)}, u32[], token[]) recv(%after-all.10), channel_id=1, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_host_transfer_rendezvous="ppermute.31_0",_xla_megascale_target={{100000->200000}},_xla_megascale_transfer_type="ONE_TO_ONE"}
  ROOT %t = (s32[], bf16[2,8]{1,0}) tuple(%gte, %x)
}

ENTRY %main.9_spmd (a: f32[64]) -> f32[] {
  %a = f32[64]{0} parameter(0)
  %while.5 = (s32[], bf16[2,8]{1,0}) while(%init), condition=%cond.2, body=%body.2
  %send.3 = (f32[64]{0:T(128)}, u32[], token[]) send(%a, %after-all), channel_id=3, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_host_transfer_rendezvous="all-reduce.17_0",_xla_megascale_reduce_operation="SUM",_xla_megascale_target="{1,2}x{0:3}",_xla_megascale_transfer_type="ALL_REDUCE"}
  %all-gather.3 = bf16[256,64]{1,0} all-gather(%w), channel_id=3, replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT %r = f32[] constant(0)
}
"""


def test_dcn_collectives_count_the_sends_across_slices():
  got = dcn_collectives(DCN_HLO)
  assert got == {"collective-permute": {"count": 3, "bytes": 3 * 2 * 8 * 2},
                 "all-reduce": {"count": 1, "bytes": 64 * 4},
                 "total": {"count": 4, "bytes": 3 * 32 + 256}}
  assert dcn_collectives(HLO) == {"total": {"count": 0, "bytes": 0}}


# Matmuls as XLA:TPU writes them: an int8 projection inside a fusion called from a
# 4-trip layer loop (a convolution whose bf16 result hides the s8 operands), and a bf16
# dot in the entry computation (the head).
MATMUL_HLO = """HloModule jit_train_step, entry_computation_layout={()->f32[]}

%fused_computation.1 (param_0: s8[64,32], param_1: s8[32,16]) -> bf16[64,16] {
  %param_0 = s8[64,32]{1,0} parameter(0)
  %param_1 = s8[32,16]{1,0} parameter(1)
  ROOT %convolution.3 = bf16[64,16]{1,0:T(8,128)(2,1)} convolution(%param_0, %param_1), dim_labels=bf_io->bf, metadata={op_name="jit(train_step)/jvp(Transformer)/while/body/closed_call/layers/ffn/wi/MD,DF->MF/dot_general"}
}

%cond.1 (p: (s32[])) -> pred[] {
  %p = (s32[]) parameter(0)
  %gte = s32[] get-tuple-element(%p), index=0
  %constant.7 = s32[] constant(4)
  ROOT %lt = pred[] compare(%gte, %constant.7), direction=LT
}

%body.1 (p: (s32[])) -> (s32[]) {
  %p = (s32[]) parameter(0)
  %x = s8[64,32]{1,0} parameter(1)
  %w = s8[32,16]{1,0} parameter(2)
  %fusion.2 = bf16[64,16]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_computation.1
  ROOT %t = (s32[]) tuple(%gte)
}

ENTRY %main.9_spmd (a: bf16[8,16], b: bf16[16,256]) -> f32[] {
  %a = bf16[8,16]{1,0} parameter(0)
  %b = bf16[16,256]{1,0} parameter(1)
  %while.5 = (s32[]) while(%init), condition=%cond.1, body=%body.1
  %dot.4 = f32[8,256]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %r = f32[] constant(0)
}
"""


def test_matmuls_by_operand_type_with_loop_trips_and_flops():
  got = matmul_ops(MATMUL_HLO)
  assert got["s8"]["count"] == 4 and got["s8"]["flops"] == 4 * 2 * 64 * 16 * 32
  assert got["s8"]["modules"] == {"layers/ffn/wi": 4}
  assert got["bf16"]["count"] == 1 and got["bf16"]["flops"] == 2 * 8 * 256 * 16
  assert got["total"]["count"] == 5

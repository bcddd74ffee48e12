"""Collective bytes read from a compiled HLO module: ops in a loop count once per trip."""

import pytest

from train.aot.hlo import collective_bytes

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

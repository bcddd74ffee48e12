"""Dropless expert parallelism's per-chip memory follows the chip's own tokens (issue 36).

The moe preset's train step once needed 165 GiB of temporaries per chip on v5p-64: the
ragged receive buffer was sized from the batch of the whole expert group's data axes,
not this chip's rows (docs/PERFORMANCE.md, "The moe preset on v5p-64"). At a fixed
per-chip batch, 4x the chips (FSDP 2 -> 8, expert axis 2) must leave the compiled
temporaries per chip about where they were; the old sizing grew the MoE buffers 4x.
"""

import pytest

from experiments.configs import pod
from train.aot import compile_for_topology, libtpu_available

pytestmark = [pytest.mark.aot, pytest.mark.skipif(
    not libtpu_available(), reason="libtpu is not installed: make test-aot")]
PER_CHIP, SEQ = 4, 512


def _temporaries(topology: str, chips: int) -> int:
  config = pod.get_config("preset=moe,smoke")
  config.model.update(d_model=256, expert_mlp_dim=128, max_seq_len=SEQ)  # megablox's widths
  config.mesh.update(data=1, fsdp=chips // 2, expert=2)
  config.data.update(seq_len=SEQ, batch_size=PER_CHIP * chips)
  config.eval.batch_size = PER_CHIP * chips
  assert config.model.moe_dispatch == "expert_parallel_ragged"
  r = compile_for_topology(config, topology, steps=("train",), try_remat=False,
                           roofline=False)
  assert r["fits"], r["steps"]["train"]["memory"]
  return r["steps"]["train"]["memory"]["temporaries"]


def test_ragged_expert_parallel_temporaries_scale_with_local_tokens():
  small, large = _temporaries("v5e:2x2", 4), _temporaries("v5e:4x4", 16)
  assert large < 1.25 * small, (small, large)

"""Two runs' logged losses compared line by line (runs that must train the same: another
loss chunking, another remat policy).

    from tests.losses import loss_mismatches, run_losses
    assert not loss_mismatches(run_losses(a), run_losses(b), rtol=1e-6)
"""

from __future__ import annotations

import numpy as np

from train import load_run


def run_losses(workdir) -> list[tuple]:
  """(step, split, loss, bpb) of every metrics line with a loss or a bpb."""
  return [(r["step"], r["split"], r.get("loss", r.get("ce_loss")), r.get("bpb"))
          for r in load_run(str(workdir)).metrics if "loss" in r or "bpb" in r]


def loss_mismatches(want: list[tuple], got: list[tuple], rtol: float) -> list[str]:
  """What differs: the lines' steps and splits, or a loss / bpb beyond `rtol`; [] when
  the runs agree. `want` must hold an eval line (else the comparison would miss bpb)."""
  if len(got) != len(want) or not any(s == "eval" for _, s, *_ in want):
    return [f"{len(got)} lines vs {len(want)} (with an eval line: "
            f"{any(s == 'eval' for _, s, *_ in want)})"]
  out = []
  for (sa, pa, la, ba), (sb, pb, lb, bb) in zip(want, got):
    if (sa, pa) != (sb, pb):
      out.append(f"line {sb} {pb} where {sa} {pa} was expected")
    elif not np.isclose(lb, la, rtol=rtol, atol=0):
      out.append(f"step {sa} {pa} loss {lb} vs {la}")
    elif ba is not None and not np.isclose(bb, ba, rtol=rtol, atol=0):
      out.append(f"step {sa} {pa} bpb {bb} vs {ba}")
  return out

"""GQA ablation: num_kv_heads in {N, N/2, N/4, ..., 1} (MHA -> GQA -> MQA) at
fixed everything else, times seeds. Parameter count and KV-cache bytes per
token fall with the KV heads; the report sets them beside the loss.

  python launch.py --config experiments/configs/gqa_ablation.py:smoke --workdir runs/gqa --sweep
  python -m experiments.report runs/gqa

arg (comma-separated, e.g. `size=small,seeds=2,task=mqar`):
  size=tiny|small|medium   model preset (base.py); N = its num_heads
  seeds=3                  training seeds 0..seeds-1 per point
  task=text|mqar           the base corpus, or synthetic associative recall
  smoke                    seconds-long runs (tests, CI)
"""

from experiments import sweep as sweep_lib
from experiments.configs import base


def _arg(arg):
  return base.parse_arg(arg, size="tiny", smoke=False, seeds=3, task="text")


def get_config(arg: str | None = None):
  a = _arg(arg)
  c = base.get_config(arg)
  c.name = "gqa_ablation"
  sweep_lib.set_task(c, a.task)
  return c


def kv_head_counts(num_heads: int) -> list[int]:
  """N, N/2, N/4, ... while the halving divides N, and always 1 (MQA)."""
  counts = [num_heads]
  while counts[-1] % 2 == 0:
    counts.append(counts[-1] // 2)
  return counts if counts[-1] == 1 else counts + [1]


def sweep(arg: str | None = None) -> list[dict]:
  c = get_config(arg)
  return [{"name": f"kv{k}-s{s}", "model.num_kv_heads": k, "train.seed": s}
          for k in kv_head_counts(c.model.num_heads) for s in sweep_lib.seeds(_arg(arg).seeds)]

"""GQA ablation: num_kv_heads in {N, N/2, N/4, ..., 1} (MHA -> GQA -> MQA) at
fixed everything else, times seeds. Parameter count and KV-cache bytes per
token fall with the KV heads; the report sets them beside the loss.

  python launch.py --config experiments/configs/gqa_ablation.py:smoke --workdir runs/gqa --sweep
  python -m experiments.report runs/gqa

arg (comma-separated, e.g. `size=small,seeds=2,task=mqar`):
  size=tiny|small|medium   model preset (base.py); N = its num_heads
  seeds=3                  training seeds 0..seeds-1 per point
  task=text|mqar           the base corpus, or synthetic associative recall with the
                           settings of experiments/configs/mqar_task.py (its 2-layer
                           d_model=64 model, keeping the preset's num_heads)
  steps=N                  train.steps of the trained points (uptraining: uptrain x N);
                           a --config.train.steps flag would set every point's, uptraining too
  uptrain=0.1              also uptrain (Ainslie et al. 2023, GQA paper section 2.1): each
                           seed's MHA run is converted to every K < N by mean-pooling the
                           K/V heads of each group (`--mode convert`) and trained on for
                           uptrain x train.steps more steps; points kv<K>-conv-s<seed>
                           evaluate the conversion before, kv<K>-up-s<seed> after uptraining
  mla=1                    also multi-head latent attention (DeepSeek-V2, model/attention/mla.py) at
                           matched KV-cache bytes per token: point mla-kv<K>-s<seed> caches
                           kv_lora_rank + qk_rope_head_dim = 2 K H values per token and layer,
                           as kv<K> caches K keys and values (`mla_points`)
  cpu                      the CPU preset (base.apply_cpu: d_model 64, 2 layers, 800 steps
                           of 16 x 64 tokens): kv4 vs kv1 differ beyond seed noise, the
                           whole sweep in under 30 minutes on 2 cores (docs/ablations.md)
  smoke                    seconds-long runs (tests, CI)
"""

from experiments import sweep as sweep_lib
from experiments.configs import base, mqar_task
from train.spec import model_config


def _arg(arg):
  return base.parse_arg(arg, **base.ARGS, seeds=3, task="text", uptrain=0.0,
                        steps=0, mla=False, cpu=False)


def get_config(arg: str | None = None):
  a = _arg(arg)
  c = base.get_config(a)
  c.name = "gqa_ablation"
  if a.cpu:
    base.apply_cpu(c, a)
  sweep_lib.set_task(c, a.task)
  if a.task == "mqar":
    mqar_task.apply(c, smoke=a.smoke)
  if a.steps:  # Here, not as --config.train.steps, so that uptrain=α scales it.
    c.train.steps = a.steps
    c.train.warmup_steps = min(c.train.warmup_steps, a.steps)
  return c


def kv_head_counts(num_heads: int) -> list[int]:
  """N, N/2, N/4, ... while the halving divides N, and always 1 (MQA)."""
  counts = [num_heads]
  while counts[-1] % 2 == 0:
    counts.append(counts[-1] // 2)
  return counts if counts[-1] == 1 else counts + [1]


def sweep(arg: str | None = None) -> list[dict]:
  a, c = _arg(arg), get_config(arg)
  counts = kv_head_counts(c.model.num_heads)
  points = [{"name": f"kv{k}-s{s}", "model.num_kv_heads": k, "train.seed": s}
            for k in counts for s in sweep_lib.seeds(a.seeds)]
  if a.mla:
    points += mla_points(c, counts, a.seeds)
  if a.uptrain:
    if not 0 < a.uptrain <= 1:
      raise ValueError(f"uptrain={a.uptrain}: must be a fraction of train.steps in (0, 1]")
    steps = max(1, round(a.uptrain * c.train.steps))
    for k in counts[1:]:
      for s in sweep_lib.seeds(a.seeds):
        # The converted model continues pre-training at the source's lr, no new warmup,
        # over the fraction's steps (the paper uptrains with the original recipe).
        points.append({"name": f"kv{k}-up-s{s}", "convert_from": f"kv{counts[0]}-s{s}",
                       "model.num_kv_heads": k, "train.seed": s, "train.steps": steps,
                       "train.warmup_steps": 0, "train.eval_every": steps,
                       "train.checkpoint_every": steps})
        points.append({"name": f"kv{k}-conv-s{s}", "eval_of": f"kv{k}-up-s{s}",
                       "eval_step": 0})
  return points


def mla_points(c, counts: list[int], seeds: int) -> list[dict]:
  """MLA beside each kv<K> with the same cache per token: a latent of 2 K H - P values plus
  the P-dim shared rope key (P, qk_nope and v head dims: ModelConfig's defaults from H),
  full-rank queries. Only where the latent is at most d_model wide (a compression of the
  token; wider, it would be MHA-or-more in disguise)."""
  model = c.model
  cfg = model_config(c).replace(attention_type="mla", num_kv_heads=model.num_heads)
  H, P = cfg.resolved_head_dim, cfg.mla_dims.qk_rope_head_dim
  return [{"name": f"mla-kv{k}-s{s}", "model.attention_type": "mla",
           "model.num_kv_heads": model.num_heads, "model.kv_lora_rank": 2 * k * H - P,
           "train.seed": s}
          for k in counts if 0 < 2 * k * H - P <= model.d_model
          for s in sweep_lib.seeds(seeds)]

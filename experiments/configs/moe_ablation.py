"""MoE ablation: a dense FFN vs a Mixture-of-Experts FFN with the same ACTIVE
parameters, and MoE load balancing none vs auxiliary loss vs loss-free (router
bias), times seeds.

Equal active parameters: each of the R routed experts has mlp_dim / R hidden
units, so a token passes through R * 3*D*(F/R) = 3*D*F FFN weights, as in the
dense model (plus the router's D*E); total parameters grow E/R-fold.

  python launch.py --config experiments/configs/moe_ablation.py:smoke --workdir runs/moe --sweep

arg (comma-separated):
  size=tiny|small|medium   model preset (base.py)
  experts=8, topk=2        E experts, R routed per token (smoke: E <= 4)
  seeds=3                  training seeds 0..seeds-1 per point
  task=text|mqar           the base corpus, or synthetic associative recall
  ep=N                     expert parallelism: experts sharded over a mesh axis of N
                           devices, tokens moved by all_to_all (moe_dispatch=
                           "expert_parallel"); the data axis takes the other devices
  cpu                      the CPU preset (base.apply_cpu: d_model 64, 2 layers, 800 steps
                           of 16 x 64 tokens), the whole sweep in under 30 minutes on 2
                           cores; balancing's MaxVio differs beyond seed noise there, the
                           loss does not (docs/ablations.md, "On a CPU")
  smoke                    seconds-long runs (tests, CI)

  python launch.py --config experiments/configs/moe_ablation.py:ep=8 --workdir runs/moe_ep --sweep
"""

from experiments import sweep as sweep_lib
from experiments.configs import base

BALANCING = {"none": "none", "aux": "aux_loss", "lossfree": "loss_free"}  # Name -> field value.


def _arg(arg):
  return base.parse_arg(arg, **base.ARGS, seeds=3, task="text", experts=8,
                        topk=2, ep=1, cpu=False)


def get_config(arg: str | None = None):
  """The MoE model (loss-free balancing); the sweep's dense point sets num_experts=0."""
  a = _arg(arg)
  c = base.get_config(a)
  c.name = "moe_ablation"
  if a.cpu:
    base.apply_cpu(c, a)
  sweep_lib.set_task(c, a.task)
  experts = min(a.experts, 4) if a.smoke else a.experts
  if not 1 <= a.topk <= experts:
    raise ValueError(f"topk={a.topk}: must be in [1, experts={experts}]")
  if c.model.mlp_dim % a.topk:
    raise ValueError(f"topk={a.topk}: must divide mlp_dim={c.model.mlp_dim} so that the "
                     "routed experts together match the dense FFN's width")
  c.model.update(num_experts=experts, experts_per_token=a.topk,
                 expert_mlp_dim=c.model.mlp_dim // a.topk, load_balance="loss_free")
  if a.ep > 1:
    if experts % a.ep:
      raise ValueError(f"ep={a.ep}: must divide the number of experts ({experts})")
    c.model.moe_dispatch = "expert_parallel"
    c.mesh.update(data=-1, expert=a.ep)
  return c


def sweep(arg: str | None = None) -> list[dict]:
  c = get_config(arg)
  e, r = c.model.num_experts, c.model.experts_per_token
  variants = [("dense", {"model.num_experts": 0, "model.load_balance": "none"})]
  variants += [(f"moe{e}x{r}-{short}", {"model.num_experts": e, "model.load_balance": value})
               for short, value in BALANCING.items()]
  return [{"name": f"{name}-s{s}", **fields, "train.seed": s}
          for name, fields in variants for s in sweep_lib.seeds(_arg(arg).seeds)]

"""Pod-scale presets: the models users train on TPU pods, for `--mode compile` (and, on a
pod, training). Sizes follow published models; the vocabularies are theirs.

  preset=125m   GPT-2-small width, 12 layers, MHA, ~135M parameters, seq 2048
  preset=1b     Llama 3.2 1B: 16 layers, d 2048, GQA 32/8, tied embeddings, seq 4096
  preset=8b     Llama 3.1 8B: 32 layers, d 4096, GQA 32/8, seq 8192
  preset=llama2_7b  Llama 2 7B: 32 layers, d 4096, MHA 32, mlp 11008, vocab 32000, seq 4096
  preset=16b    MaxText's `global_parameter_scale=16` default model (its v5e-256
                benchmark): 32 layers, d 4096, 64 heads of 128 (MHA), mlp 28672,
                vocab 32000, seq 2048
  preset=moe    OLMoE-1B-7B: 16 layers, 64 experts top-8 (expert_mlp_dim 1024), expert
                parallelism with ragged all-to-all (mesh.expert=8), seq 4096
  preset=mixtral  Mixtral 8x7B: 32 layers, d 4096, GQA 32/8, 8 experts top-2
                (expert_mlp_dim 14336), capacity factor 1.25, vocab 32000, seq 4096;
                MaxText's anchor: v6e-256 at 12 x 4096 per chip (batch=3072)
  preset=mla    DeepSeek-V2-Lite attention (kv_lora_rank 512, rope 64, nope 128) on a
                dense 16-layer d 2048 model, seq 4096
  preset=70b    Llama 2 70B: 80 layers, d 8192, GQA 64/8, mlp 28672, vocab 32000, seq 4096;
                MaxText's anchor: v6e-256 at 4 x 4096 per chip, remat full
  preset=405b   Llama 3.1 405B: 126 layers, d 16384, GQA 128/8, mlp 53248, vocab 128256,
                seq 8192; MaxText's anchor: 2 x v6e-256 at 1 x 8192 per chip, fsdp 64 x
                tensor 4 in a slice, fsdp across the two, the 8b preset's offload map
  preset=dsv3   DeepSeek-V3 (671B) shape: 61 layers (the first 3 dense, mlp 18432), d 7168,
                128 MLA heads (q_lora 1536, kv_lora 512, nope 128, rope 64, v 128), 256
                routed experts top-8 (expert_mlp_dim 2048, sigmoid scores, 8 groups of
                which 4, scale 2.5, loss-free balance) + 1 shared, vocab 129280, seq 8192;
                MaxText's anchor: 2 x v6e-256 at 1 x 8192 per chip, fsdp 16 x expert 16,
                capacity factor 1.0, the layer input offloaded. Not modelled: the
                multi-token-prediction module (blockwork has none), and MaxText's
                plain SGD on bf16 weights (here AdamW on float32, as every preset)
  batch=N       global batch in sequences (default 256); a pod needs a multiple of its
                data-parallel size (data * fsdp * expert)
  smoke         the same structure, seconds-long (tests)

Every preset computes in bfloat16 (float32 parameters and optimizer state) and shards
the state over all chips with FSDP (mesh.fsdp=-1); change it with --config.mesh.*.

A preset is a recipe: its remat policy (and offload map) is the one its row of the pod
table (docs/PERFORMANCE.md, "Pod table") compiles with, so the table's commands need no
memory flags (REMAT below; 125m and mla have no row and keep remat=none). Another policy
is one flag away; from a custom preset clear its map too:
--config.model.remat=full --config.model.remat_custom=

  python launch.py --mode compile --config experiments/configs/pod.py:preset=8b \\
      --topology v6e-256
"""

from experiments.configs import base

_LLAMA3_VOCAB = 128256
PRESETS = {
    "125m": dict(vocab_size=32768, d_model=768, num_layers=12, num_heads=12, num_kv_heads=12,
                 mlp_dim=2048, max_seq_len=2048),
    "1b": dict(vocab_size=_LLAMA3_VOCAB, d_model=2048, num_layers=16, num_heads=32,
               num_kv_heads=8, mlp_dim=8192, max_seq_len=4096, tie_embeddings=True,
               rope_theta=500_000.0),
    "8b": dict(vocab_size=_LLAMA3_VOCAB, d_model=4096, num_layers=32, num_heads=32,
               num_kv_heads=8, mlp_dim=14336, max_seq_len=8192, rope_theta=500_000.0),
    "llama2_7b": dict(vocab_size=32000, d_model=4096, num_layers=32, num_heads=32,
                      num_kv_heads=32, mlp_dim=11008, max_seq_len=4096),
    "16b": dict(vocab_size=32000, d_model=4096, num_layers=32, num_heads=64, num_kv_heads=64,
                head_dim=128, mlp_dim=28672, max_seq_len=2048),
    "moe": dict(vocab_size=50304, d_model=2048, num_layers=16, num_heads=16, num_kv_heads=16,
                mlp_dim=1024, max_seq_len=4096, num_experts=64, experts_per_token=8,
                expert_mlp_dim=1024, load_balance="aux_loss",
                moe_dispatch="expert_parallel_ragged", qk_norm=True),
    # MaxText's v6e-256 recipe: capacity 1.25, dense (non-megablox) expert matmuls, FSDP
    # over all chips; here the capacity einsums ("auto" on a mesh), fsdp=-1.
    "mixtral": dict(vocab_size=32000, d_model=4096, num_layers=32, num_heads=32,
                    num_kv_heads=8, mlp_dim=14336, max_seq_len=4096, num_experts=8,
                    experts_per_token=2, expert_mlp_dim=14336, capacity_factor=1.25,
                    load_balance="aux_loss", rope_theta=1_000_000.0),
    "70b": dict(vocab_size=32000, d_model=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                mlp_dim=28672, max_seq_len=4096),
    "405b": dict(vocab_size=_LLAMA3_VOCAB, d_model=16384, num_layers=126, num_heads=128,
                 num_kv_heads=8, mlp_dim=53248, max_seq_len=8192, rope_theta=500_000.0),
    "dsv3": dict(vocab_size=129280, d_model=7168, num_layers=61, num_heads=128,
                 num_kv_heads=128, mlp_dim=18432, max_seq_len=8192, attention_type="mla",
                 q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                 qk_rope_head_dim=64, v_head_dim=128, num_experts=256, experts_per_token=8,
                 expert_mlp_dim=2048, num_shared_experts=1, first_k_dense=3,
                 router_score="sigmoid", router_groups=8, router_topk_groups=4,
                 route_scale=2.5, load_balance="loss_free", capacity_factor=1.0,
                 # MaxText's dense (non-megablox) path shards the dispatched tokens over
                 # the expert axis: that is "expert_parallel" here (its all-to-all). The
                 # mesh's capacity einsums ("auto") split the batch and gather all 256
                 # experts' weights on every chip (40.20 GiB of temporaries with one MoE
                 # layer, 27.23 with this; docs/PERFORMANCE.md).
                 moe_dispatch="expert_parallel"),
    "mla": dict(vocab_size=102400, d_model=2048, num_layers=16, num_heads=16, num_kv_heads=16,
                mlp_dim=10944, max_seq_len=4096, attention_type="mla", kv_lora_rank=512,
                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
}
# MaxText's `custom` offload for Llama 3.1 8B: the layer input and the q/k/v/out
# projections to host memory (its v6e-256 and v5e-256 recipes).
_OFFLOAD_8B = ("decoder_layer_input=offload,query_proj=offload,key_proj=offload,"
               "value_proj=offload,out_proj=offload")
# Each preset's memory recipe: the policy of its pod-table row(s). llama2_7b has two rows:
# minimal is its v5p-128 row at the preset's 4096; its v5e-256 row (MaxText's recipe at
# seq 2048) adds --config.model.remat=save_qkv_proj with the shorter sequence.
REMAT = {
    "1b": dict(remat="full"),
    "8b": dict(remat="custom", remat_custom=_OFFLOAD_8B),
    "llama2_7b": dict(remat="minimal"),
    "16b": dict(remat="full"),
    "moe": dict(remat="full"),
    "mixtral": dict(remat="custom", remat_custom="decoder_layer_input=offload"),
    "70b": dict(remat="full"),
    "405b": dict(remat="custom", remat_custom=_OFFLOAD_8B),
    "dsv3": dict(remat="custom", remat_custom="decoder_layer_input=offload"),
}
# Mesh per preset beyond fsdp=-1 (expert parallelism for the MoE).
# 405b and dsv3: MaxText's in-slice split (fsdp 64 x tensor 4; fsdp 16 x expert 16); their
# rows put fsdp across the two slices (--config.mesh.dcn_fsdp=2).
MESH = {"moe": {"expert": 8}, "405b": {"fsdp": 64, "tensor": 4},
        "dsv3": {"fsdp": 16, "expert": 16}}


def get_config(arg: str | None = None):
  a = base.parse_arg(arg, **base.ARGS, preset="1b", batch=256)
  if a.preset not in PRESETS:
    raise ValueError(f"config argument preset={a.preset!r}: must be one of {sorted(PRESETS)}")
  c = base.get_config(base.parse_arg(None, **base.ARGS))  # Smoke last: it shrinks the preset.
  c.name = f"pod_{a.preset}"
  c.model.update(dtype="bfloat16", param_dtype="float32", **PRESETS[a.preset],
                 **REMAT.get(a.preset, {}))
  c.mesh.update({"data": 1, "fsdp": -1, **MESH.get(a.preset, {})})
  c.data.seq_len = c.model.max_seq_len
  c.data.batch_size = a.batch
  c.eval.batch_size = a.batch
  c.train.warmup_steps = 2000
  c.train.steps = 100_000
  if a.smoke:
    base.apply_smoke(c)
    # 0: MLA's dims from head_dim (DeepSeek-V2's ratios); None: head_dim from d_model.
    # remat none: a pod's memory recipe (host offload included) is not a CPU test's.
    # dsv3: no query latent, one routing group (smoke's 4 experts), one dense layer of 2.
    c.model.update(vocab_size=512, head_dim=None, kv_lora_rank=0, qk_nope_head_dim=0,
                   qk_rope_head_dim=0, v_head_dim=0, remat="none", remat_custom="",
                   q_lora_rank=0, router_groups=1, router_topk_groups=1,
                   first_k_dense=min(c.model.first_k_dense, 1))
    c.mesh.update(data=-1, fsdp=1, expert=1, tensor=1)
  return c

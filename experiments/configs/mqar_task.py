"""`task=mqar` of the GQA ablation: settings under which multi-query associative
recall (train/data/mqar.py) is learned on a 2-core CPU within minutes (docs/data.md, "MQAR").

A Zoology-sized model (Arora et al. 2023: 2 layers, d_model 64), keeping the size
preset's head count so the sweep over KV heads is the same. The initialisation
scale is what matters most: at the text default init_std=0.02 the attention
logits start so small that the induction circuit (a previous-token head in
layer 1, a key-matching head in layer 2) takes thousands of steps to form, and
the model sits at the "one of the context's values" plateau; at 0.1 (about
1/sqrt(d_model)) MHA leaves the plateau after ~600 steps and recalls >= 0.95 of
the bindings by step 900 (docs/data.md, "MQAR at CPU scale" has the measured sweep).
"""

from __future__ import annotations

import ml_collections

MODEL = dict(d_model=64, num_layers=2, mlp_dim=128, init_std=0.1)
DATA = dict(seq_len=64, batch_size=64, mqar_num_kv_pairs=8, mqar_vocab=256)
# Constant lr after warmup: the circuit forms late (~step 600), and a cosine decay over
# 1000 steps had halved the lr by then (MHA at step 1000: 0.64 and 0.82 recall, 2 seeds).
TRAIN = dict(steps=1200, lr=3e-3, schedule="constant", warmup_steps=100, eval_every=300,
             checkpoint_every=600, log_every=50)
EVAL = dict(batches=4, batch_size=64)


def apply(c: ml_collections.ConfigDict, smoke: bool = False) -> ml_collections.ConfigDict:
  """`c` set to train on MQAR; `smoke` keeps the smoke run's shapes and length."""
  c.data.corpus = "mqar"
  c.model.init_std = MODEL["init_std"]
  if smoke:
    return c
  c.model.update({k: v for k, v in MODEL.items() if k != "init_std"})
  c.model.vocab_size = DATA["mqar_vocab"]
  c.data.update(DATA)
  c.train.update(TRAIN)
  c.eval.update(EVAL)
  return c

"""MQAR batches: every weighted target is the value bound to the queried key, nothing else is weighted."""

import json
import os

import ml_collections
import numpy as np
import pytest

from tests.cli import ROOT, launch
from train.data import mqar
from train.data.pipeline import make_source

N, V, L = 6, 64, 40


def _cfg(**overrides):
  return ml_collections.ConfigDict({
      "corpus": "mqar", "mqar_num_kv_pairs": N, "mqar_vocab": V, "mqar_power_a": 0.01,
      "seq_len": L, "worker_count": 0, **overrides})


def _source(**kw):
  return make_source(_cfg(), None, **kw)


def test_make_source_hook_and_tokenizer():
  src = _source()
  assert isinstance(src, mqar.MQARSource) and src.vocab_size == V
  tok = src.tokenizer
  np.testing.assert_array_equal(tok.token_bytes, np.ones(V))  # bpb = bits per answer.
  assert tok.decode(tok.encode("3 17 63")) == "3 17 63"
  with pytest.raises(ValueError, match="outside"):
    tok.encode("64")


def _check_row(b, r):
  inputs, targets, w = b["inputs"][r], b["targets"][r], b["weights"][r]
  np.testing.assert_array_equal(inputs[1:], targets[:-1])  # Next-token targets.
  keys, values = inputs[0:2 * N:2], inputs[1:2 * N:2]
  assert len(set(keys)) == N and len(set(values)) == N
  assert keys.max() < V // 2 <= values.min() and values.max() < V
  binding = dict(zip(keys.tolist(), values.tolist()))
  answers = np.flatnonzero(w)
  assert set(np.unique(w)) <= {0.0, 1.0}
  # Every key queried once, after the context; its target is the bound value.
  assert sorted(inputs[answers].tolist()) == sorted(keys.tolist())
  assert answers.min() >= 2 * N
  assert [binding[k] for k in inputs[answers].tolist()] == targets[answers].tolist()
  length = len(inputs)
  np.testing.assert_array_equal(b["positions"][r], np.arange(length))
  np.testing.assert_array_equal(b["segment_ids"][r], np.ones(length))


def test_batches_weight_exactly_the_answers():
  it = _source().train_iterator(seed=3, batch_size=4, seq_len=L)
  for _ in range(3):
    b = next(it)
    assert b["inputs"].shape == (4, L) and b["weights"].dtype == np.float32
    for r in range(4):
      _check_row(b, r)
  for b in _source().eval_batches(4, 2 * L, 2):  # Longer contexts: same pairs, more noise.
    assert b["inputs"].shape == (4, 2 * L)
    for r in range(4):
      _check_row(b, r)


def test_resume_and_host_split_are_exact():
  src = _source()
  it = src.train_iterator(seed=1, batch_size=4, seq_len=L)
  next(it)
  state = json.loads(json.dumps(it.get_state()))
  expected = next(it)
  again = src.train_iterator(seed=1, batch_size=4, seq_len=L)
  again.set_state(state)
  np.testing.assert_array_equal(next(again)["inputs"], expected["inputs"])
  halves = [next(_source(process_index=p, process_count=2).train_iterator(1, 4, L))
            for p in range(2)]
  whole = next(src.train_iterator(1, 4, L))
  np.testing.assert_array_equal(np.concatenate([h["inputs"] for h in halves]), whole["inputs"])
  other_seed = next(src.train_iterator(2, 4, L))
  assert not np.array_equal(other_seed["inputs"], whole["inputs"])


def test_eval_batches_fixed_and_disjoint_from_train():
  a, b = _source().eval_batches(4, L, 2), _source().eval_batches(4, L, 2)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x["inputs"], y["inputs"])
  train = next(_source().train_iterator(0, 4, L))
  assert not np.array_equal(a[0]["inputs"], train["inputs"])


def test_bad_configs_name_the_field():
  with pytest.raises(ValueError, match="data.mqar_num_kv_pairs"):
    make_source(_cfg(seq_len=4 * N - 2), None)
  with pytest.raises(ValueError, match="data.mqar_vocab"):
    mqar.MQARSpec(num_kv_pairs=N, vocab_size=2 * N - 1)
  with pytest.raises(ValueError, match="data.mqar_power_a"):
    mqar.MQARSpec(num_kv_pairs=N, vocab_size=V, power_a=0.0)


def test_task_mqar_recipe_learns_the_binding(tmp_path):
  """gqa_ablation.py:task=mqar's recipe, at toy size (4 pairs, 16 tokens, vocabulary 32),
  recalls the bindings after 160 steps: eval accuracy far above the H_4/4 = 0.52 a model
  reaches by copying "some value of the context, not yet answered" (the plateau at
  which the text default init_std=0.02 sits for thousands of steps). Measured: 0.31 at
  step 100, 0.92 at 140, 1.0 at 160 and after."""
  run = tmp_path / "mqar"
  launch("--config", os.path.join(ROOT, "experiments/configs/gqa_ablation.py:task=mqar"),
         "--workdir", str(run), "--config.data.seq_len=16", "--config.data.mqar_vocab=32",
         "--config.data.mqar_num_kv_pairs=4", "--config.model.vocab_size=32",
         "--config.train.steps=160", "--config.train.eval_every=160",
         "--config.train.checkpoint_every=160", "--config.train.tensorboard=False")
  with open(run / "metrics.jsonl") as f:
    evals = [r for r in map(json.loads, f) if r["split"] == "eval"]
  assert evals[-1]["step"] == 160 and evals[-1]["accuracy"] > 0.9, evals

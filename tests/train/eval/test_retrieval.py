"""Passkey / multi-needle retrieval: the samples, the scores' meaning, the length refusal
and the passkey mixture of training rows."""

import time

import jax
import ml_collections
import numpy as np
import pytest

from model import ModelConfig, Transformer
from train.data.tokenizers import ByteTokenizer
from train.eval import retrieval
from train.eval.scoring import Scorer

TOK = ByteTokenizer()


def _text(ids):
  return TOK.decode(ids)


@pytest.mark.parametrize("length", [128, 300])
def test_samples_have_the_length_and_the_needle_at_its_depth(length):
  where = []
  for depth in (0.0, 0.5, 1.0):
    s = retrieval.make_sample(TOK, length, depth, 1, np.random.default_rng(0))
    assert len(s.prompt) + len(s.keys[0]) == length
    text, key = _text(s.prompt), _text(s.keys[0])
    assert text.endswith("What is the pass key? The pass key is ")
    assert text.count(f"The pass key is {key}.") == 1 and len(set(map(_text, s.keys))) == 10
    where.append(text.index(key) / len(text))
  assert where == sorted(where) and where[-1] - where[0] > 0.3 * (length > 128)


def test_multi_needle_hides_every_key_and_asks_for_the_first():
  s = retrieval.make_sample(TOK, 400, 0.5, 4, np.random.default_rng(3), candidates=6)
  text = _text(s.prompt)
  names = [n for n in retrieval.NAMES if f"The pass key of {n} is" in text]
  assert len(names) == 4
  asked = text.rsplit("What is the pass key of ", 1)[1].split("?")[0]
  assert f"The pass key of {asked} is {_text(s.keys[0])}." in text
  # The other needles' keys are the first distractors (hard negatives).
  assert sum(f"is {_text(k)}." in text for k in s.keys[1:]) == 3


def test_exact_is_greedy_decoding_and_rank_counts_better_keys():
  cfg = ModelConfig(vocab_size=256, d_model=32, num_layers=1, num_heads=2, num_kv_heads=2,
                    mlp_dim=64, max_seq_len=64, pos_encoding="rope")
  variables = Transformer(cfg).init(jax.random.key(0), np.zeros((1, 8), np.int32))
  prompt = list(b"The pass key is ")
  forward = jax.jit(lambda ids: Transformer(cfg).apply(variables, ids))
  greedy = []
  for _ in range(4):  # Greedy decoding, one full forward per token (one shape, one compile).
    ids = np.zeros((1, 32), np.int32)
    ids[0, :len(prompt) + len(greedy)] = prompt + greedy
    greedy.append(int(np.argmax(forward(ids)[0, len(prompt) + len(greedy) - 1])))
  wrong = greedy[:3] + [(greedy[3] + 1) % 256]
  scorer = Scorer(cfg, variables, batch_size=4, min_bucket=32)
  (lp_g, ok_g), (lp_w, ok_w) = scorer.score([(prompt + greedy, 4), (prompt + wrong, 4)])
  assert ok_g and not ok_w and lp_g > lp_w
  s = retrieval.Sample(prompt, [wrong, greedy], 0.0, len(prompt) + 4)
  ((exact, rank, logp),) = retrieval.score(scorer, [s])
  assert (exact, rank, logp) == (False, 2, pytest.approx(lp_w))


def test_retrieval_past_a_learned_position_table_is_refused_before_compiling():
  cfg = ModelConfig(vocab_size=256, d_model=32, num_layers=1, num_heads=2, num_kv_heads=2,
                    mlp_dim=64, max_seq_len=256, pos_encoding="learned")
  e = ml_collections.ConfigDict({"retrieval_lengths": (1, 2, 4), "retrieval_depths": (0.5,),
                                 "retrieval_samples": 1, "retrieval_candidates": 2,
                                 "task_batch_size": 2})
  t0 = time.perf_counter()
  with pytest.raises(ValueError, match=r"retrieval at 512 tokens, inputs: 511 tokens exceed "
                     r"ModelConfig.max_seq_len=256, the size of the learned position table"):
    retrieval.run_retrieval("passkey", cfg, {"params": {}}, TOK, e, 128)
  assert time.perf_counter() - t0 < 1


def test_passkey_mixture_replaces_rows_the_same_on_every_host_count():
  from experiments.configs import base  # pylint: disable=g-import-not-at-top
  from train.data.pipeline import make_source  # pylint: disable=g-import-not-at-top
  c = base.get_config("smoke")
  c.data.update(passkey_fraction=0.5, seq_len=128)
  one = make_source(c.data, None, read_only=True)
  whole = [one.train_dataset(0, 16, 128)[k] for k in range(4)]
  two = [make_source(c.data, None, p, 2, read_only=True).train_dataset(0, 16, 128)[1]
         for p in range(2)]
  np.testing.assert_array_equal(np.concatenate([b["inputs"] for b in two]),
                                whole[1]["inputs"])
  rows = [(b["inputs"][r], b["targets"][r]) for b in whole for r in range(16)]
  mixed = [(i, t) for i, t in rows if _text(i).find("The pass key is") >= 0]
  assert 0.3 < len(mixed) / len(rows) < 0.7
  for inputs, targets in mixed:
    key = _text(inputs).split("The pass key is ")[1][:5]
    assert _text(targets).endswith(f"The pass key is {key}")


def test_passkey_at_chance_at_every_length_is_logged_with_the_recipe(caplog):
  """Issue 46 item 4: an untrained model's exact match is 0 at L and 2L: the evaluation
  says it measured nothing and names the passkey recipe; a model that retrieves once
  does not warn."""
  cfg = ModelConfig(vocab_size=256, d_model=32, num_layers=1, num_heads=2, num_kv_heads=2,
                    mlp_dim=64, max_seq_len=256, pos_encoding="rope")
  variables = Transformer(cfg).init(jax.random.key(0), np.zeros((1, 8), np.int32))
  e = ml_collections.ConfigDict({"retrieval_lengths": (1, 2), "retrieval_depths": (0.5,),
                                 "retrieval_samples": 1, "retrieval_candidates": 2,
                                 "task_batch_size": 4})
  with caplog.at_level("WARNING", logger="train.eval.retrieval"):
    figs = retrieval.run_retrieval("passkey", cfg, variables, TOK, e, 112)
  assert figs["passkey/exact"] == figs["passkey/exact@224"] == 0.0
  assert "eval.tasks=passkey: exact match is 0.00 at every length (112, 224 tokens)" in caplog.text
  assert "The passkey recipe" in caplog.text and "data.passkey_fraction" in caplog.text
  caplog.clear()
  assert not retrieval.warn_at_chance("passkey", {**figs, "passkey/exact@224": 0.25}, [112])
  assert not caplog.text

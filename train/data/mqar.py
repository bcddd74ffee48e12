"""Multi-query associative recall (MQAR; Arora et al. 2023, "Zoology") as a data source.

Each sequence first binds N keys to N values, then queries every key once,
at gaps drawn from a power law, between random noise tokens:

    k1 v1 k2 v2 ... kN vN | noise .. k3 v3 .. noise .. k1 v1 .. kN vN .. noise
    `------ context -----'   `------------------ queries -----------------'

Keys come from the lower half of the vocabulary and values from the upper
half, each without repetition inside a sequence, so the only way to predict
the token after a queried key is to recall its binding from the context.
Training and evaluation weigh only those answers (weights = 1 on the input
position holding a queried key, whose target is its value), so eval
`accuracy` is recall accuracy, and `loss` / `bpb` are nats / bits per answer.

Examples are a pure function of (seed, index): train example i is the same on
every host and after a restart, and evaluation sets are identical across runs
(they do not depend on the train seed) at every context length.

Against Zoology's reference generator (HazyResearch/zoology,
zoology/data/multiquery_ar.py, `random_non_queries=True`, `num_passes=1`):
- Same: values from [V/2, V) without repetition; noise uniform over the whole
  vocabulary (so noise may repeat a key or a value); N distinct query slots after
  the context, slot g (0-based) with probability ~ (g+1)**(a-1), a = power_a,
  over (L - 2N) // 2 slots; queries in random order; loss and accuracy only on
  the answers.
- Keys come from [0, V/2); Zoology's from [1, V/2) (it reserves 0 as the
  placeholder that noise later overwrites; nothing here needs one).
- Here the value also follows its queried key in the input ("k v" recurs as a
  bigram, so targets are always the next input token, as in language
  modelling); in Zoology the token after a queried key is noise and the value
  is only a label. Consequence: a model that has not learned the binding can
  still rule out values already answered earlier in the sequence, so the
  no-binding plateau is H_N / N (N = 4: 0.52, 8: 0.34), not 1/N.
- Train examples are drawn fresh for every step (no epochs); Zoology draws a
  fixed set (e.g. 100k examples at L = 64, N = 4) and trains on it for many
  epochs. Its test sets vary N and L; here `eval.context_lengths` varies L at
  the trained N (benchmarks/mqar_curve.py varies N).
- Zoology asserts V > L (its default V = 8192) and even L; here V >= 2N and
  L + 1 >= 4N suffice. Zoology's JRT repetition (`num_passes` > 1) is absent.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import grain
import numpy as np

from train.data.tokenizers import fingerprint
from train.data.source import Source, check_seed, fixed_batches, host_batches, local_rows

_TRAIN, _EVAL = 0, 1  # RNG stream ids: train and eval examples never share a seed.
_UNBOUNDED = 2**62  # Train examples are drawn fresh; the iterator never wraps around.


@dataclasses.dataclass(frozen=True)
class MQARSpec:
  num_kv_pairs: int  # N: bindings per sequence, each queried once.
  vocab_size: int  # Keys from [0, V/2), values from [V/2, V), noise from [0, V).
  power_a: float = 0.01  # Query-gap law p(g) ~ a * g**(a-1) (Zoology): mostly short gaps.

  def __post_init__(self):
    if not isinstance(self.num_kv_pairs, int) or self.num_kv_pairs < 1:
      raise ValueError(f"data.mqar_num_kv_pairs={self.num_kv_pairs!r}: must be a positive "
                       "integer")
    if self.vocab_size < 2 * self.num_kv_pairs:
      raise ValueError(f"data.mqar_vocab={self.vocab_size}: must be >= 2 * "
                       f"data.mqar_num_kv_pairs = {2 * self.num_kv_pairs} (distinct keys and "
                       "values)")
    if not 0 < self.power_a <= 1:
      raise ValueError(f"data.mqar_power_a={self.power_a!r}: must be in (0, 1]")

  def check_length(self, seq_len: int) -> None:
    # Context (2N tokens) plus N query pairs, within the L + 1 tokens of a window.
    if seq_len + 1 < 4 * self.num_kv_pairs:
      raise ValueError(f"data.mqar_num_kv_pairs={self.num_kv_pairs}: a sequence of "
                       f"seq_len={seq_len} holds at most {(seq_len + 1) // 4} pairs (each "
                       "pair appears twice: bound, then queried)")


def make_example(spec: MQARSpec, seq_len: int, rng: np.random.Generator) -> dict:
  """One sequence: {"inputs", "targets", "positions", "segment_ids": int32 [L],
  "weights": float32 [L]}, weight 1 exactly on the positions of queried keys."""
  spec.check_length(seq_len)
  n, v, half = spec.num_kv_pairs, spec.vocab_size, spec.vocab_size // 2
  keys = rng.choice(half, n, replace=False)
  values = half + rng.choice(v - half, n, replace=False)
  tok = rng.integers(0, v, seq_len + 1)  # Noise everywhere not overwritten below.
  tok[0:2 * n:2], tok[1:2 * n:2] = keys, values
  slots = (seq_len + 1 - 2 * n) // 2  # Non-overlapping (key, value) query slots.
  law = spec.power_a * np.arange(1, slots + 1, dtype=np.float64) ** (spec.power_a - 1)
  gaps = rng.choice(slots, n, replace=False, p=law / law.sum())
  order = rng.permutation(n)  # Queries come in an order unrelated to the bindings.
  query_at = 2 * n + 2 * gaps
  tok[query_at], tok[query_at + 1] = keys[order], values[order]
  weights = np.zeros([seq_len], np.float32)
  weights[query_at] = 1.0  # Input is the queried key; its target is the bound value.
  return {
      "inputs": tok[:-1].astype(np.int32),
      "targets": tok[1:].astype(np.int32),
      "positions": np.arange(seq_len, dtype=np.int32),
      "segment_ids": np.ones([seq_len], np.int32),
      "weights": weights,
  }


class _Examples:
  """Picklable index -> example map (grain workers run it)."""

  def __init__(self, spec: MQARSpec, seq_len: int, stream: Sequence[int]):
    self.spec, self.seq_len, self.stream = spec, seq_len, tuple(stream)

  def __call__(self, index: int) -> dict:
    rng = np.random.default_rng([*self.stream, int(index)])
    return make_example(self.spec, self.seq_len, rng)


class MQARTokenizer:
  """The identity on token ids; text is ids separated by spaces ("3 17 200")."""

  eos_id = None

  def __init__(self, vocab_size: int):
    self.vocab_size = vocab_size
    self.token_bytes = np.ones([vocab_size], np.int32)  # bpb = bits per answer token.

  def encode(self, text: str) -> list[int]:
    try:
      ids = [int(t) for t in text.split()]
    except ValueError:
      raise ValueError(f"MQAR text must be token ids separated by spaces, got {text!r}"
                       ) from None
    bad = [i for i in ids if not 0 <= i < self.vocab_size]
    if bad:
      raise ValueError(f"token ids {bad} outside the MQAR vocabulary [0, {self.vocab_size})")
    return ids

  def decode(self, ids) -> str:
    return " ".join(str(int(i)) for i in np.asarray(ids).reshape(-1)
                    if 0 <= i < self.vocab_size)

  def identity(self) -> tuple[str, bytes]:
    return "mqar", str(self.vocab_size).encode()


@dataclasses.dataclass
class MQARSource(Source):
  """Synthetic MQAR sequences, fresh for every train index (no epochs)."""
  spec: MQARSpec
  process_index: int = 0
  process_count: int = 1
  worker_count: int = 0
  tokenizer: MQARTokenizer = dataclasses.field(init=False)
  info: dict[str, Any] = dataclasses.field(init=False)

  def __post_init__(self):
    self.tokenizer = MQARTokenizer(self.spec.vocab_size)
    self.info = {"corpus": "mqar", **dataclasses.asdict(self.spec),
                 "tokenizer_fingerprint": fingerprint(self.tokenizer)}

  def train_dataset(self, seed: int, batch_size: int, seq_len: int,
                    process_index: int | None = None,
                    process_count: int | None = None) -> grain.MapDataset:
    """Host p of P gets rows [p*b, (p+1)*b) of every global batch, b = batch_size / P."""
    p = self.process_index if process_index is None else process_index
    n = self.process_count if process_count is None else process_count
    local_rows(batch_size, p, n)
    check_seed(seed)
    self.spec.check_length(seq_len)
    ds = grain.MapDataset.range(_UNBOUNDED).map(_Examples(self.spec, seq_len, (_TRAIN, seed)))
    return host_batches(ds, batch_size, p, n)

  def eval_batches(self, batch_size: int, seq_len: int, num_batches: int) -> list[dict]:
    """This host's rows of `num_batches` fixed batches; the same for every run."""
    local_rows(batch_size, self.process_index, self.process_count)
    if num_batches < 1:
      raise ValueError(f"num_batches={num_batches} must be positive")
    self.spec.check_length(seq_len)
    picks_JB = np.arange(num_batches * batch_size).reshape(num_batches, batch_size)
    return fixed_batches(_Examples(self.spec, seq_len, (_EVAL, seq_len)), picks_JB,
                         self.process_index, self.process_count)


def make_source(data_cfg, process_index: int = 0, process_count: int = 1) -> MQARSource:
  """The source for `data.corpus = "mqar"` (fields data.mqar_*)."""
  missing = [f for f in ("mqar_num_kv_pairs", "mqar_vocab", "mqar_power_a")
             if getattr(data_cfg, f) is None]
  if missing:
    raise ValueError(f"data.corpus='mqar' needs data.{', data.'.join(missing)} "
                     "(see experiments/configs/base.py)")
  spec = MQARSpec(int(data_cfg.mqar_num_kv_pairs), int(data_cfg.mqar_vocab),
                  float(data_cfg.mqar_power_a))
  spec.check_length(int(data_cfg.seq_len))
  return MQARSource(spec, process_index, process_count,
                    worker_count=int(data_cfg.worker_count))

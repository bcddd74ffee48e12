"""A blockwork model as an lm-evaluation-harness (`lm_eval`) language model.

    from train.eval.harness import BlockworkLM
    lm = BlockworkLM(run.model_config, run.variables, run.tokenizer)
    lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"], task_manager=...)

Requests are encoded as the harness's Hugging Face backend encodes them
(trailing context spaces move to the continuation; the pair is encoded whole and
split at the context's length; too-long rows lose tokens on the left), so the
two backends score the same tokens. Log-likelihoods go through
train/eval/scoring.py's bucketed, batched `Scorer`; `generate_until` through the
KV-cache decoder (model/decode, greedy), cut at the first stop string.

A tokenizer without BOS/EOS (the byte tokenizer) has no token to condition an
empty context on: there the first token of the text is context and is not
scored (in `loglikelihood_rolling` too).
"""

from __future__ import annotations

import logging
from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from model import ModelConfig
from train.eval.scoring import Scorer
from train.generate import generate

log = logging.getLogger(__name__)


class BlockworkLM(TemplateLM):
  """`lm_eval` model over (ModelConfig, variables, tokenizer): what load_run gives."""

  def __init__(self, cfg: ModelConfig, variables: Any, tokenizer, *, batch_size: int = 16,
               max_len: int | None = None, min_bucket: int = 64, max_gen_toks: int = 256):
    super().__init__()
    self.cfg, self.variables, self.tok = cfg, variables, tokenizer
    self.scorer = Scorer(cfg, variables, batch_size, max_len, min_bucket)
    self.max_length = self.scorer.max_len
    self.batch_size = int(batch_size)
    self.max_gen_toks = int(max_gen_toks)
    self.untokenizable: dict[str, int] = {}  # Texts that do not decode back to themselves.
    self.requests = 0

  @property
  def eot_token_id(self) -> int | None:
    return self.tok.eos_id

  @property
  def prefix_token_id(self) -> int | None:
    bos = getattr(self.tok, "bos_id", None)
    return bos if bos is not None else self.tok.eos_id

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs
                 ) -> list[int]:
    del add_special_tokens, kwargs
    return list(self.tok.encode(string))

  def _check_roundtrip(self, text: str, ids: list[int]) -> None:
    self.requests += 1
    if text and self.tok.decode(ids) != text:
      self.untokenizable[text[:40]] = self.untokenizable.get(text[:40], 0) + 1

  def _with_prefix(self, ids: list[int]) -> tuple[list[int], list[int]]:
    """(context, scored) for a text with no context of its own."""
    prefix = self.prefix_token_id
    return ([prefix], ids) if prefix is not None else (ids[:1], ids[1:])

  def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
    del disable_tqdm
    pairs = []
    for context, continuation in (r.args for r in requests):
      if context:
        ctx, cont = self._encode_pair(context, continuation)
      else:
        ctx, cont = self._with_prefix(self.tok_encode(continuation))
      whole_text = not context and self.prefix_token_id is not None  # cont is all of it.
      self._check_roundtrip(context + continuation, cont if whole_text else ctx + cont)
      pairs.append(((context, continuation), ctx, cont))
    return self._loglikelihood_tokens(pairs)

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs
                            ) -> list[tuple[float, bool]]:
    del disable_tqdm, kwargs
    rows = []
    for _, ctx, cont in requests:
      if not cont:  # Nothing to score (an empty continuation): log 1.
        rows.append(None)
        continue
      whole = (list(ctx) + list(cont))[-(self.max_length + 1):]
      rows.append((whole, min(len(cont), len(whole) - 1)))
    scored = iter(self.scorer.score([r for r in rows if r is not None]))
    return [(0.0, True) if r is None else next(scored) for r in rows]

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    del disable_tqdm
    rows, owner = [], []
    for i, (text,) in enumerate(r.args for r in requests):
      ids = self.tok_encode(text)
      self._check_roundtrip(text, ids)
      (prefix,), ids = self._with_prefix(ids) if ids else ([None], [])
      if not ids:
        continue
      for ctx, pred in map(make_disjoint_window, get_rolling_token_windows(
          ids, prefix, self.max_length, context_len=1)):
        rows.append((list(ctx) + list(pred), len(pred)))
        owner.append(i)
    totals = [0.0] * len(requests)
    for i, (logp, _) in zip(owner, self.scorer.score(rows)):
      totals[i] += logp
    return totals

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    del disable_tqdm
    out: list[str | None] = [None] * len(requests)
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(requests):
      _, kwargs = r.args
      until, max_new = _stops(kwargs, self.max_gen_toks)
      groups.setdefault((until, max_new), []).append(i)
    for (until, max_new), members in groups.items():
      for lo in range(0, len(members), self.batch_size):
        chunk = members[lo:lo + self.batch_size]
        prompts = []
        for i in chunk:
          context = requests[i].args[0]
          ids = self.tok_encode(context) or [self.prefix_token_id or 0]  # Never empty.
          self._check_roundtrip(context, ids)
          prompts.append(ids[-max(1, self.max_length - max_new):])
        padded = prompts + [prompts[0]] * (self.batch_size - len(prompts))  # One shape.
        new_ids = generate(self.cfg, self.variables, padded, max_new,
                           eos_id=self.tok.eos_id, pad_to_multiple=self.scorer.min_bucket)
        for i, ids in zip(chunk, new_ids):
          out[i] = cut_at_stops(self.tok.decode(ids), until)
    return out  # type: ignore[return-value]


def _stops(kwargs: dict | None, default_max: int) -> tuple[tuple[str, ...], int]:
  """(stop strings, max new tokens) of a request's generation kwargs."""
  kwargs = dict(kwargs or {})
  if kwargs.get("do_sample") and float(kwargs.get("temperature", 1.0)) > 0:
    log.warning("generate_until: do_sample requested; the blockwork adapter decodes greedily")
  until = kwargs.get("until") or []
  until = (until,) if isinstance(until, str) else tuple(until)
  return until, int(kwargs.get("max_gen_toks", default_max))


def cut_at_stops(text: str, until: tuple[str, ...]) -> str:
  """`text` up to the first occurrence of any stop string."""
  cut = min((text.find(s) for s in until if s and s in text), default=len(text))
  return text[:cut]

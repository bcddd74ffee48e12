"""Weighted mixtures of prepared datasets and named evaluation corpora, through launch.py:
realised proportions, exact resume, weights changed on resume, per-domain bpb."""

import json
import os
import shutil

import numpy as np
import pytest

from experiments.configs.base import get_config
from experiments.report import collect
from tests.cli import SMOKE, launch
from tests.train.data import corpus_files
from train.data import named
from train.data.mixture import schedule
from train.data.pipeline import make_source
from train.data.prepare import prepare
from train.lifecycle.resume import RunDirError
from train.metrics import read_metrics
from train.spec import parse

STEPS, BATCH, SEQ = 10, 8, 32  # tiny.py:smoke


@pytest.fixture(scope="module")
def mix(tmp_path_factory):
  root = tmp_path_factory.mktemp("mixture")
  code = root / "code_src"
  code.mkdir()
  for i, text in enumerate(corpus_files.documents("def f", 40, words=60)):
    (code / f"m{i}.txt").write_text(text)
  corpus_files.write_jsonl(str(root / "docs.jsonl"), corpus_files.documents("Docs", 200))
  other = root / "other"
  other.mkdir()
  (other / "a.txt").write_text("".join(corpus_files.documents("never trained on", 30)))
  kw = dict(workers=0, progress=False, val_fraction=0.2)
  prepare([str(code)], str(root / "code"), **kw)
  prepare([str(root / "docs.jsonl")], str(root / "docs"), **kw)
  flags = ["--config.data.corpus=mixture",
           f"--config.data.datasets=code={root}/code,docs={root}/docs"]
  run = str(root / "run")
  launch("--workdir", run, *flags, "--config.data.mixture=code:0.7,docs:0.3",
         f"--config.eval.corpora=other={other}")
  return root, flags, run


def _last(run, split):
  return [r for r in read_metrics(run) if r["split"] == split][-1]


def test_realised_mixture_is_the_weights_and_logged_per_domain(mix):
  _, _, run = mix
  train = _last(run, "train")
  rows = {d: train[f"tokens_seen/{d}"] // SEQ for d in ("code", "docs")}
  assert rows == {"code": 56, "docs": 24}  # 70/30 of 80 rows, exactly.
  assert train["tokens_seen"] == STEPS * BATCH * SEQ
  picks = schedule(np.array([0.7, 0.3]), np.zeros(2), 1000)  # Never over one row off.
  drift = np.abs(np.cumsum(picks == 0) - 0.7 * np.arange(1, 1001))
  assert drift.max() <= 1.0


def test_per_domain_bpb_is_in_metrics_and_report_and_equals_each_domain_alone(mix):
  root, _, run = mix
  ev = _last(run, "eval")
  for d in ("code", "docs", "other"):
    assert np.isfinite(ev[f"bpb/{d}"]) and np.isfinite(ev[f"loss/{d}"])
  assert ev["bpb/other"] > ev["bpb/code"]  # Out of domain is harder, even after 10 steps.
  # The checkpoint evaluated on the code dataset alone: headline bpb == the run's bpb/code.
  alone = os.path.join(root, "code_alone")
  shutil.copytree(run, alone)
  cfg = json.load(open(os.path.join(alone, "config.json")))
  cfg["data"].update(corpus=str(root / "code"), mixture="")
  cfg["eval"]["corpora"] = ""
  json.dump(cfg, open(os.path.join(alone, "config.json"), "w"))
  out = launch("--mode", "eval", "--workdir", alone)
  bpb = float(out.split("bpb ")[1].split()[0]) if "bpb " in out else None
  record = json.loads(open(os.path.join(alone, "evals.jsonl")).readline())
  np.testing.assert_allclose(record["bpb"], ev["bpb/code"], rtol=1e-6)
  assert bpb is None or abs(bpb - record["bpb"]) < 1e-4
  columns, rows, _ = collect(run)  # The report's results.csv / tables columns.
  assert {"bpb/code", "bpb/docs", "bpb/other"} <= set(columns)
  assert rows[0]["bpb/code"] == ev["bpb/code"]


def test_eval_mode_on_a_corpus_never_trained_on(mix):
  root, _, run = mix
  extra = root / "extra"
  extra.mkdir()
  (extra / "x.txt").write_text("".join(corpus_files.documents("fresh text", 20)))
  out = launch("--mode", "eval", "--workdir", run, f"--config.eval.corpora=fresh={extra}")
  assert "bpb/fresh" in out and "bpb/code" in out


def test_mixture_iterator_resumes_exactly_and_hosts_split_the_global_batch(mix):
  root, _, _ = mix
  d = get_config().data
  d.update(corpus="mixture", datasets=f"code={root}/code,docs={root}/docs",
           mixture="code:0.7,docs:0.3")
  source = make_source(d, None)
  it = source.train_iterator(1, BATCH, SEQ)
  for _ in range(3):
    next(it)
  state = json.loads(json.dumps(it.get_state()))  # As the checkpoint stores it.
  expected = [next(it) for _ in range(2)]
  again = source.train_iterator(1, BATCH, SEQ)
  again.set_state(state)
  hosts = [source.train_iterator(1, BATCH, SEQ, p, 2) for p in range(2)]
  for h in hosts:
    h.set_state(state)
  for want in expected:
    got, halves = next(again), [next(h) for h in hosts]
    for key in want:
      np.testing.assert_array_equal(got[key], want[key])
      np.testing.assert_array_equal(np.concatenate([h[key] for h in halves]), want[key])


def test_weights_change_on_resume_is_refused_then_recorded_and_positions_continue(mix):
  root, flags, run = mix
  changed = str(root / "changed")
  shutil.copytree(run, changed)
  new = ["--config.data.mixture=code:0.5,docs:0.5", f"--config.eval.corpora=other={root}/other",
         "--config.train.steps=14"]
  with pytest.raises(RunDirError, match="data.mixture"):
    launch("--workdir", changed, *flags, *new)
  launch("--workdir", changed, *flags, *new, "--allow_config_change")
  before, after = _last(run, "train"), _last(changed, "train")
  # Steps 11-14 under 0.5/0.5: 32 rows, 16 per domain, each continuing its own order
  # (the checkpointed positions: a restarted iterator would count from 0).
  drawn = {d: (after[f"tokens_seen/{d}"] - before[f"tokens_seen/{d}"]) // SEQ
           for d in ("code", "docs")}
  assert drawn == {"code": 16, "docs": 16}
  change = [json.loads(line) for line in open(os.path.join(changed, "config_changes.jsonl"))]
  assert any(c["field"] == "data.mixture" and c["step"] == STEPS for c in change)


def test_bad_mixtures_are_refused_naming_the_field(mix):
  root, _, _ = mix
  datasets = {"code": str(root / "code"), "docs": str(root / "docs")}
  with pytest.raises(ValueError, match="'web' is not a dataset named in data.datasets"):
    named.mixture_weights("web:0.5,code:0.5", datasets)
  with pytest.raises(ValueError, match="weights must be positive"):
    named.mixture_weights("code:0,docs:1", datasets)
  c = get_config("smoke")
  c.data.update(corpus=str(root / "code"), mixture="code:1")
  with pytest.raises(ValueError, match="config.data.mixture"):
    parse(c, 8)
  assert SMOKE  # The mixture runs above use the smoke config (tests/cli.py).


def test_config_json_records_what_stands_behind_every_bpb(mix):
  """Each evaluation corpus (issue 37): its files, fingerprint and tokens; the report marks
  the one outside the training mixture as out-of-domain."""
  root, _, run = mix
  recorded = json.load(open(os.path.join(run, "config.json")))["_run"]["data"]["eval_corpora"]
  assert set(recorded) == {"code", "docs", "other"}
  other = recorded["other"]
  text = (root / "other" / "a.txt").read_text()
  assert (other["kind"], other["files"], other["path"]) == ("text", 1, str(root / "other"))
  assert other["tokens"] == len(text.encode()) + 0  # Byte tokenizer, no EOS.
  import hashlib  # pylint: disable=g-import-not-at-top
  assert other["fingerprint"] == "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]
  assert other["evaluated_tokens"] == 2 * 8 * SEQ  # eval.batches x batch_size x seq_len.
  assert recorded["code"]["kind"].startswith("mixture domain") and recorded["code"]["tokens"] > 0
  from experiments.report import tables as report_tables  # pylint: disable=g-import-not-at-top
  from experiments.report import _ood  # pylint: disable=g-import-not-at-top
  _, rows, _ = collect(run)
  assert _ood(rows) == {"bpb/other"}
  header = report_tables.markdown([], [], ["bpb/code", "bpb/other"], _ood(rows)).splitlines()[0]
  assert "| code bits/byte | Δ code bits/byte [95% CI] | other bits/byte (OOD) |" in header


def test_config_json_records_the_realised_share_in_tokens_and_bytes(mix):
  """Issue 46 item 5: data.mixture counts tokens by default; config.json's _run.data says
  what share of tokens and of bytes each domain gets."""
  root, flags, run = mix
  data = json.load(open(os.path.join(run, "config.json")))["_run"]["data"]
  assert data["mixture_unit"] == "tokens"
  share = data["mixture_share"]
  assert share["tokens"] == pytest.approx({"code": 0.7, "docs": 0.3})
  per_token = {d: data["datasets"][d]["train_bytes"] / data["datasets"][d]["train_tokens"]
               for d in ("code", "docs")}
  code_bytes = 0.7 * per_token["code"] / (0.7 * per_token["code"] + 0.3 * per_token["docs"])
  assert share["bytes"] == pytest.approx({"code": code_bytes, "docs": 1 - code_bytes}, abs=1e-5)


def test_mixture_unit_bytes_weights_each_domains_text(mix, tmp_path):
  """data.mixture_unit=bytes: a domain whose tokens hold fewer bytes gets more rows, so
  that the byte shares are the weights (here SentencePiece on one domain only)."""
  root, flags, _ = mix
  spm = tmp_path / "spm"
  prepare([str(root / "code_src")], str(spm), workers=0, progress=False, val_fraction=0.2,
          tokenizer="sentencepiece", vocab_size=300)
  model = str(spm / "tokenizer" / "spm.model")
  prepare([str(root / "docs.jsonl")], str(tmp_path / "docs"), workers=0, progress=False,
          val_fraction=0.2, tokenizer="sentencepiece", vocab_size=300, spm_model=model)
  c = get_config("smoke")
  c.data.update(corpus="mixture", datasets=f"code={spm},docs={tmp_path / 'docs'}",
                mixture="code:0.5,docs:0.5", tokenizer="sentencepiece", vocab_size=300,
                spm_model=model, mixture_unit="bytes")
  source = make_source(c.data, None, read_only=True)
  share = source.info["mixture_share"]
  assert share["bytes"] == pytest.approx({"code": 0.5, "docs": 0.5}, abs=1e-5)
  assert share["tokens"]["code"] != pytest.approx(0.5, abs=0.01)  # Unequal bytes/token.
  assert source.weights == pytest.approx(share["tokens"], abs=1e-5)
  c.data.mixture_unit = "chars"
  with pytest.raises(ValueError, match="data.mixture_unit"):
    parse(c, 8)


def test_the_report_shows_the_mixture_share_in_both_units(mix, tmp_path):
  from experiments import report  # pylint: disable=g-import-not-at-top
  _, _, run = mix
  written = report.write_report(run, str(tmp_path / "report"))
  md = open(written["markdown"]).read()
  assert "Mixture share per domain, of tokens / of bytes" in md
  assert "- `.`: code 70.0% / " in md and ", docs 30.0% / " in md
  assert "code 70.0% / " in written.notes

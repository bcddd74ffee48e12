"""The fit search's logic (train/aot/fit.py) with a fake compile: CPU only, no libtpu.

Properties: the search finds the exact largest fitting batch from above or below and
never asks the same batch twice; with a memory model it predicts the boundary and
compiles little more than to confirm it; policies go from full upward, the ones asked
(--fit_policies) only; the recommendation is the fastest estimate and its flags set the
global batch; a re-run with the same arguments reuses the ledger's trials (compiling
nothing) and a file of another search is refused; the one capacity figure of
train/aot/report.py is XLA's usable HBM.
"""

import json

import pytest

from experiments.configs import pod
from train.aot import fit, report
from train.aot.topology import GiB, parse_topology


@pytest.mark.parametrize("start", [1, 3, 8, 40, 256])
@pytest.mark.parametrize("limit", [0, 1, 5, 17, 64, 256])
@pytest.mark.parametrize("capacity", [None, 1000.0])
def test_largest_fitting_is_exact_and_asks_each_batch_once(start, limit, capacity):
  asked = []
  def measure(b):  # HBM linear in the batch: 1000 bytes hold `limit` sequences and a half.
    asked.append(b)
    return b <= limit, (b + 0.3) * 1000.0 / (limit + 0.5)
  best, _ = fit.largest_fitting(measure, start, ceiling=256, capacity=capacity)
  assert best == (limit or None)
  assert len(asked) == len(set(asked)) and len(asked) <= 2 * 9 + 1
  assert all(1 <= b <= 256 for b in asked)
  if capacity is not None:  # Predicted: two trials to measure, at most three to confirm.
    assert len(asked) <= 5, asked


def test_policies_from_full_upward_the_ones_asked():
  assert fit.policies(("none", "full", "save_dots")) == ["full", "save_dots", "none"]
  assert fit.policies() == list(fit.DEFAULT_POLICIES) and fit.policies()[0] == "full"
  order = fit.policies(("minimal", "custom", "full", "none"))
  assert order == ["custom", "full", "minimal", "none"]
  assert fit.policies(["all"]) == list(reversed(fit.RECOMPUTE_ORDER))
  with pytest.raises(ValueError, match="--fit_policies=full,fulll"):
    fit.policies(["full", "fulll"])


def test_the_measured_order_covers_every_named_policy():
  """Every ModelConfig.remat but custom, most device HBM first as compiled for TPU
  (benchmarks/remat_memory.py; docs/model.md, "Remat policies")."""
  from model import remat  # pylint: disable=g-import-not-at-top
  assert set(fit.RECOMPUTE_ORDER) == set(remat.NAMES) - {"custom"}


def _fake(limits, speed, hbm, calls):
  def fake(config, topo_, roofline):
    remat, b = config.model.remat, config.data.batch_size // topo_.num_chips
    assert config.data.batch_size % topo_.num_chips == 0
    calls.append((remat, b, roofline))
    ok = b <= limits[remat]
    s = {"fits": ok, "hbm_bytes": hbm, "compile_s": 1.0,
         "memory": {"total": int(hbm * (b + .25) / (limits[remat] + .5))}}
    if roofline:
      assert ok  # The roofline is computed only for the batch found.
      tokens = b * config.data.seq_len * topo_.num_chips
      step = 0.1 * b / speed[remat] + 0.05  # Fixed overhead: bigger batches are faster.
      s.update(roofline={"step_time_s": step}, tokens_per_s_estimate=tokens / step,
               mfu_estimate=0.5)
    return s
  return fake


def test_fit_search_reports_each_policy_and_recommends_the_fastest(tmp_path):
  topo = parse_topology("v5e:2x2")
  # Per-chip batch that fits, and relative speed per token, of every policy tried: the
  # more a policy keeps, the less fits (RECOMPUTE_ORDER: most HBM first).
  limits = dict(zip(fit.RECOMPUTE_ORDER, (2, 5, 6, 6, 7, 8, 9, 9, 10, 12)))
  speed = {p: 1.0 - 0.03 * i for i, p in enumerate(fit.RECOMPUTE_ORDER)}
  calls = []
  config = pod.get_config("preset=1b,smoke")
  out = str(tmp_path / "fit.json")
  r = fit.fit_search(config, topo, compile_train=_fake(limits, speed, report.capacity(topo),
                                                       calls),
                     ceiling=64, policies_asked=["all"], out=out)
  got = {row["remat"]: row["per_chip"] for row in r["policies"]}
  assert got == limits
  assert [row["remat"] for row in r["policies"]][0] == "full"
  assert len(r["trials"]) < 3 * len(limits), r["trials"]
  rec = r["recommended"]
  rates = {k: limits[k] / (0.1 * limits[k] / speed[k] + 0.05) for k in limits}
  assert rec["remat"] == max(rates, key=rates.get)
  assert rec["flags"] == (f"--config.data.batch_size={rec['per_chip'] * 4} "
                          f"--config.model.remat={rec['remat']}")
  text = fit.format_fit(r)
  assert text.splitlines()[-1] == f"recommended: {rec['flags']}"
  assert "15.75 GiB" in text  # One capacity: XLA's usable HBM on v5e.
  saved = json.loads(open(out).read())
  assert saved["finished"] and saved["trials"] == r["trials"] and saved["recommended"]

  # The same search again: every trial and roofline from the ledger, nothing compiled.
  again = []
  r2 = fit.fit_search(config, topo, compile_train=_fake(limits, speed, 1, again),
                      ceiling=64, policies_asked=["all"], out=out)
  assert again == [] and r2["reused_trials"] == len(calls)
  assert r2["recommended"] == rec
  saved = json.loads(open(out).read())
  # Another search (another sequence length) into that file: refused, the file kept.
  other = pod.get_config("preset=1b,smoke")
  other.data.seq_len = 16
  with pytest.raises(ValueError, match="holds a fit search of other arguments"):
    fit.fit_search(other, topo, compile_train=_fake(limits, speed, 1, again), out=out)
  assert json.loads(open(out).read()) == saved


def test_the_json_is_written_after_every_trial(tmp_path):
  topo = parse_topology("v5e:2x2")
  out = tmp_path / "fit.json"
  limits = {"full": 5, "save_qkv_proj": 3}
  inner = _fake(limits, {p: 1.0 for p in limits}, report.capacity(topo), [])
  seen = []

  def compile_train(config, topo_, roofline):
    seen.append(len(json.loads(out.read_text())["trials"]) if out.exists() else 0)
    return inner(config, topo_, roofline)

  r = fit.fit_search(pod.get_config("preset=1b,smoke"), topo, compile_train=compile_train,
                     policies_asked=["full", "save_qkv_proj"], roofline=False, out=str(out))
  assert seen == list(range(len(r["trials"])))  # Before each compile: every earlier trial.
  assert [row["per_chip"] for row in r["policies"]] == [5, 3]


def test_nothing_fits_says_so():
  topo = parse_topology("v5e:2x2")
  fake = lambda c, t, roofline: {"fits": False, "hbm_bytes": 1, "memory": {"total": 2}}
  r = fit.fit_search(pod.get_config("preset=1b,smoke"), topo, compile_train=fake, ceiling=8)
  assert "recommended" not in r and all(row["per_chip"] is None for row in r["policies"])
  assert [row.get("skipped") is None for row in r["policies"]] == [True, False, False]
  assert "none fits" in fit.format_fit(r)


class _Refused:
  shapes, seconds, argument_bytes = {"batch": 8}, 1.0, 2 * GiB
  out_of_memory = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory "
                   "in memory space hbm. Used 20.00G of 15.75G hbm. HLO temporaries "
                   "(18.00G) exceeds available HBM (15.75G)")
  executable = None


def test_a_refused_and_a_fitting_step_share_one_capacity():
  topo = parse_topology("v5e-16")
  assert report.capacity(topo) == int(15.75 * GiB)
  refused = report.step_report(_Refused(), topo)
  assert refused["hbm_bytes"] == report.capacity(topo) and not refused["fits"]
  assert abs(refused["xla_available_bytes"] - 15.75 * GiB) < 1e-3 * GiB
  for gen in ("v5e", "v5p", "v6e"):
    chip = parse_topology(f"{gen}-16").chip
    assert 0.97 * chip.hbm_bytes < chip.usable_hbm_bytes < chip.hbm_bytes

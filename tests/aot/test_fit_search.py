"""The fit search's logic (train/aot/fit.py) with a fake compile: CPU only, no libtpu.

Properties: the binary search finds the exact largest fitting batch from above or below
with few compiles and never asks the same batch twice; policies go cheapest recompute
first, full last; the recommendation is the fastest estimate and its flags set the
global batch; the one capacity figure of train/aot/report.py is XLA's usable HBM.
"""

import pytest

from experiments.configs import pod
from train.aot import fit, report
from train.aot.topology import GiB, parse_topology


@pytest.mark.parametrize("start", [1, 3, 8, 40, 256])
@pytest.mark.parametrize("limit", [0, 1, 5, 17, 64, 256])
def test_largest_fitting_is_exact_and_asks_each_batch_once(start, limit):
  asked = []
  def fits(b):
    asked.append(b)
    return b <= limit
  best = fit.largest_fitting(fits, start, ceiling=256)
  assert best == (limit or None)
  assert len(asked) == len(set(asked)) and len(asked) <= 2 * 9 + 1
  assert all(1 <= b <= 256 for b in asked)


def test_policies_cheapest_recompute_first_full_last():
  assert fit.policies(("none", "full", "save_dots")) == ["none", "save_dots", "full"]
  order = fit.policies(("full", "minimal", "custom", "new_policy", "none"))
  assert order[0] == "none" and order[-1] == "full" and "custom" not in order
  assert order.index("minimal") < order.index("new_policy")


def test_the_search_tries_every_named_policy_in_the_measured_order():
  """Every ModelConfig.remat but custom, most device HBM first as compiled for TPU
  (benchmarks/remat_memory.py; docs/model.md, "Remat policies")."""
  from model import remat  # pylint: disable=g-import-not-at-top
  assert fit.policies() == list(fit.RECOMPUTE_ORDER)
  assert set(fit.RECOMPUTE_ORDER) == set(remat.NAMES) - {"custom"}


def test_fit_search_reports_each_policy_and_recommends_the_fastest():
  topo = parse_topology("v5e:2x2")
  # Per-chip batch that fits, and relative speed per token, of every policy tried.
  limits = dict(zip(fit.RECOMPUTE_ORDER, (2, 5, 6, 6, 7, 8, 9, 9, 10, 12)))
  speed = {p: 1.0 - 0.03 * i for i, p in enumerate(fit.RECOMPUTE_ORDER)}
  hbm = report.capacity(topo)

  def fake(config, topo_, roofline):
    remat, b = config.model.remat, config.data.batch_size // topo_.num_chips
    assert config.data.batch_size % topo_.num_chips == 0
    ok = b <= limits[remat]
    s = {"fits": ok, "hbm_bytes": hbm, "memory": {"total": int(hbm * b / (limits[remat] + .5))}}
    if roofline:
      assert ok  # The roofline is computed only for the batch found.
      tokens = b * config.data.seq_len * topo_.num_chips
      step = 0.1 * b / speed[remat] + 0.05  # Fixed overhead: bigger batches are faster.
      s.update(roofline={"step_time_s": step}, tokens_per_s_estimate=tokens / step,
               mfu_estimate=0.5)
    return s

  config = pod.get_config("preset=1b,smoke")
  r = fit.fit_search(config, topo, compile_train=fake, ceiling=64)
  got = {row["remat"]: row["per_chip"] for row in r["policies"]}
  assert got == limits
  assert [row["remat"] for row in r["policies"]][-1] == "full"
  assert all(t["remat"] in limits for t in r["trials"]) and len(r["trials"]) < 6 * len(limits)
  rec = r["recommended"]
  rates = {k: limits[k] / (0.1 * limits[k] / speed[k] + 0.05) for k in limits}
  assert rec["remat"] == max(rates, key=rates.get)
  assert rec["flags"] == (f"--config.data.batch_size={rec['per_chip'] * 4} "
                          f"--config.model.remat={rec['remat']}")
  text = fit.format_fit(r)
  assert text.splitlines()[-1] == f"recommended: {rec['flags']}"
  assert "15.75 GiB" in text  # One capacity: XLA's usable HBM on v5e.


def test_nothing_fits_says_so():
  topo = parse_topology("v5e:2x2")
  fake = lambda c, t, roofline: {"fits": False, "hbm_bytes": 1, "memory": {"total": 2}}
  r = fit.fit_search(pod.get_config("preset=1b,smoke"), topo, compile_train=fake, ceiling=8)
  assert "recommended" not in r and all(row["per_chip"] is None for row in r["policies"])
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

"""The optimizer comparison recipe (experiments/configs/optimizer_ablation.py): each
optimizer's own grid, the pick at the end of a decay, the ladder from it, and the whole
recipe at smoke size through launch.py --sweep and the report."""

import json

import pytest

from experiments import report, sweep
from experiments.configs import optimizer_ablation
from experiments.report import lr as report_lr
from tests.cli import launch
from tests.experiments.test_report import _write_run
from train.spec import parse

CONFIG = "experiments/configs/optimizer_ablation.py"


def test_tune_points_are_each_optimizers_own_grid_on_wsd_trunks_and_branches():
  pts = {p.name: p for p in sweep.points(CONFIG, "stage=tune,optimizers=adamw+lion,wds=0+1")}
  trunks = [p for p in pts.values() if p.branch_of is None]
  assert len(trunks) == 2 * 3 * 2 * 2  # optimizers x lrs x decays x tune seeds.
  lion = sorted({p.overrides["train.lr"] for p in trunks
                 if p.overrides["train.optimizer"] == "lion"})
  assert lion == [3e-4, 1e-3, 3e-3]  # Factors 1/3, 1, 3.33 of Lion's own centre.
  assert {p.overrides["train.weight_decay"] for p in trunks
          if p.overrides["train.optimizer"] == "lion"} == {0.0, 0.3}
  branch = pts["s-lion-lr0.001-wd0.3-t66-s1"]
  assert branch.branch_of == "s-lion-lr0.001-wd0.3-s1"
  c = sweep.point_config(CONFIG, "stage=tune", pts["s-lion-lr0.001-wd0.3-s1"])
  parse(c, 8)  # A valid run, as the sweep checks it.
  assert (c.train.schedule, c.train.min_lr_ratio, c.train.steps) == ("wsd", 0.0, 132)
  assert c.eval.at_start  # The loss at init of the lr sensitivity.


def test_refusals_name_the_problem():
  with pytest.raises(ValueError, match="schedule_free_adamw.*no decay"):
    sweep.points(CONFIG, "stage=tune,optimizers=adamw+schedule_free_adamw")
  with pytest.raises(ValueError, match="'sgd' is not one of"):
    sweep.points(CONFIG, "stage=tune,optimizers=sgd")
  with pytest.raises(ValueError, match="needs tuned=DIR"):
    sweep.points(CONFIG, "stage=ladder")
  with pytest.raises(ValueError, match="tuned='x' is for stage=ladder"):
    sweep.points(CONFIG, "tuned=x")
  with pytest.raises(ValueError, match="select=0.3"):
    sweep.points(CONFIG, "stage=ladder,tuned=x,select=0.3")


def _tune_run(root, name, opt, lr, seed, steps, final, best, schedule="wsd"):
  _write_run(root / name, 4, seed, final, steps=steps)
  path = root / name / "config.json"
  record = json.loads(path.read_text())
  record["train"].update(optimizer=opt, lr=lr, schedule=schedule)
  path.write_text(json.dumps(record))
  metrics = root / name / "metrics.jsonl"  # A mid-run eval far below the final loss.
  metrics.write_text(json.dumps({"step": 1, "split": "eval", "loss": best}) + "\n" +
                     metrics.read_text())


def test_tuned_settings_pick_at_the_end_of_the_decay_not_mid_run(tmp_path):
  # lr 1e-3 has the best mid-run eval; lr 3e-3 the best loss at the end of its decay.
  for s in (0, 1):
    _tune_run(tmp_path, f"a1-s{s}", "adamw", 1e-3, s, 10, 2.5, 1.0)
    _tune_run(tmp_path, f"a3-s{s}", "adamw", 3e-3, s, 10, 2.2, 2.0)
    _tune_run(tmp_path, f"l1-s{s}", "lion", 1e-3, s, 10, 2.4, 2.3)
    _tune_run(tmp_path, f"l1-t5-s{s}", "lion", 1e-3, s, 5, 2.9, 2.8)  # A branch: not picked at 10.
  best = report_lr.tuned_settings(str(tmp_path), "train.optimizer", ("train.lr",), 10)
  assert best == {"adamw": {"train.lr": 3e-3}, "lion": {"train.lr": 1e-3}}
  _tune_run(tmp_path, "c1-s0", "adamw", 1e-2, 0, 10, 2.0, 2.0, schedule="cosine")
  with pytest.raises(ValueError, match="schedule='cosine'"):
    report_lr.tuned_settings(str(tmp_path), "train.optimizer", ("train.lr",), 10)
  _write_run(tmp_path / "u-s0", 4, 0, 2.0, finished=False)
  with pytest.raises(ValueError, match="not finished .*u-s0"):
    report_lr.tuned_settings(str(tmp_path), "train.optimizer", ("train.lr",), 10)


def test_recipe_end_to_end_at_smoke_size(tmp_path):
  common = "smoke,tpp=20,optimizers=adamw+lion,wds=1"
  tune, ladder = tmp_path / "tune", tmp_path / "ladder"
  launch("--config", f"{CONFIG}:stage=tune,{common},lrs=1+3.33,tune_seeds=2",
         "--workdir", str(tune), "--sweep")
  best = report_lr.tuned_settings(str(tune), "train.optimizer",
                                  ("train.lr", "train.weight_decay"), 26)
  assert set(best) == {"adamw", "lion"}
  assert best["lion"]["train.lr"] in (1e-3, 3e-3) and best["lion"]["train.weight_decay"] == 0.3
  tuned = report.write_report(str(tune))
  md = open(tuned["lr_markdown"]).read()  # Each optimizer's lr sensitivity, Δ to AdamW's.
  lion = next(l for l in md.splitlines() if l.startswith("| s-lion-wd0.3 |"))
  assert "(n=2)" in lion and "[" in lion.split("(n=2) |")[1]
  launch("--config", f"{CONFIG}:stage=ladder,tuned={tune},{common},sizes=xs+s,seeds=2",
         "--workdir", str(ladder), "--sweep")
  cfg = json.loads((ladder / "s-lion-s1" / "config.json").read_text())
  assert cfg["train"]["lr"] == best["lion"]["train.lr"]  # The tune stage's pick.
  out = report.write_report(str(ladder))
  fits = json.loads(open(out["fits"]).read())
  assert [r["variant"].split(",")[0] for r in fits] == ["optimizer=adamw", "optimizer=lion"]
  assert fits[0]["baseline"] and fits[1]["multiplier"] is not None
  assert "compute multiplier [95% CI]" in open(out["fits_markdown"]).read()

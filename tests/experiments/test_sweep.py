"""The sweep runner: runs every point, skips finished ones, records failures, emits commands."""

import functools
import logging
import os
import re
import shlex
import subprocess
import textwrap

import pytest

from experiments import sweep
from experiments.sweep import launch as sweep_launch
from tests.cli import launch
from train.metrics import read_metrics

# Two real (2-step, MQAR) training points that differ only in their data, so the
# second compiles nothing new (persistent cache), and, with arg "bad", a point
# between them that is valid but fails as it runs: its corpus (empty.txt beside the
# config file, 4 bytes) holds no window of its validation split.
CONFIG = textwrap.dedent('''
    import os
    from experiments.configs import base

    def get_config(arg=None):
      c = base.get_config("smoke")
      c.data.update(corpus="mqar", mqar_num_kv_pairs=4, seq_len=16, batch_size=8)
      c.model.update(d_model=16, num_layers=1, num_heads=2, num_kv_heads=2, mlp_dim=32)
      c.train.update(steps=10, log_every=1, eval_every=2, checkpoint_every=2, warmup_steps=1,
                     async_checkpoint=False, tensorboard=False)
      c.eval.update(batches=1, batch_size=8)
      c.hardware.peak_flops = 1e12  # Skip measuring the device.
      return c

    def sweep(arg=None):
      points = [{"name": f"pairs{n}", "data.mqar_num_kv_pairs": n} for n in (2, 4)]
      if arg == "bad":
        points.insert(1, {"name": "bad", "data.corpus": os.path.join(os.path.dirname(__file__),
                                                                     "empty.txt")})
      if arg == "evals":  # Listed first: the sweep still trains pairs2 before evaluating it.
        points[:0] = [{"name": "pairs2-at2L", "eval_of": "pairs2", "eval.context_lengths": (1, 2)},
                      {"name": "pairs2-more", "eval_of": "pairs2", "eval.batches": 2}]
      return points
''')
STEPS = ["--config.train.steps=2"]

# Points the trainer's validation refuses (3 KV heads for 4 heads, a mixture naming no
# dataset) and one misspelt override, beside a valid point; with arg "run", two valid
# points whose corpora (beside the config file) hold no validation window: they fail
# as they run, before anything compiles.
FAILING = textwrap.dedent('''
    import os
    from experiments.configs import tiny

    def get_config(arg=None):
      return tiny.get_config("smoke")

    def sweep(arg=None):
      if arg == "run":
        here = os.path.dirname(__file__)
        return [{"name": n, "data.corpus": os.path.join(here, f"{n}.txt")} for n in ("a", "b")]
      legl = {"data.corpus": "mixture", "data.datasets": "man=m,legal=l",
              "data.mixture": "man:0.7,legl:0.3"}
      return [{"name": "ok"}, {"name": "kv3", "model.num_kv_heads": 3},
              {"name": "typo", "model.num_kv_head": 2}, {"name": "legl-s0", **legl},
              {"name": "legl-s1", **legl, "train.seed": 1}]
''')


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
  """One real sweep, shared by the tests (training is the slow part)."""
  tmp = tmp_path_factory.mktemp("sweep")
  config = str(tmp / "two_points.py")
  with open(config, "w") as f:
    f.write(CONFIG)
  (tmp / "empty.txt").write_text("abc\n")
  workdir = str(tmp / "runs")
  lines = []
  handler = logging.Handler(logging.INFO)
  handler.emit = lambda record: lines.append(record.getMessage())
  logger = logging.getLogger("experiments.sweep")
  logger.addHandler(handler)
  level, logger.level = logger.level, logging.INFO
  try:
    status = sweep.run_sweep(config, "bad", workdir, flags=STEPS)
  finally:
    logger.removeHandler(handler)
    logger.setLevel(level)
  return config, workdir, status, [l for l in lines if "; sweep: " in l]


def _evals(run_dir):
  return [r["step"] for r in read_metrics(run_dir) if r["split"] == "eval"]


def test_runs_every_point_and_records_the_failure(swept):
  config, workdir, status, progress = swept
  assert status == {"pairs2": "done", "bad": "failed", "pairs4": "done"}
  # A progress line per point: its outcome, points done of all, elapsed time and ETA.
  hms = r"\d\d:\d\d:\d\d"
  for line, (i, name, outcome) in zip(progress, [(1, "pairs2", "done"), (2, "bad", "failed"),
                                                 (3, "pairs4", "done")], strict=True):
    # A finished point's final eval figures, as it finishes.
    figures = (r" \(eval loss \d+\.\d{4}, bpb \d+\.\d{4}, accuracy \d\.\d{4}\)"
               if outcome == "done" else "")
    assert re.fullmatch(rf"sweep point {name} {outcome}{figures}; sweep: {i}/3 done, {hms} "
                        rf"elapsed, ETA {hms}", line), line
  assert progress[-1].endswith("ETA 00:00:00")
  for name in ("pairs2", "pairs4"):
    assert _evals(os.path.join(workdir, name)) == [2]  # The command line's steps=2 applied.
    # Finished means an eval at the config's last step: more steps would resume it.
    assert sweep.is_finished(os.path.join(workdir, name), 2)
    assert not sweep.is_finished(os.path.join(workdir, name), 3)
    assert not os.path.exists(os.path.join(workdir, name, sweep.FAILED))
  with open(os.path.join(workdir, "bad", sweep.FAILED)) as f:
    failure = f.read()
  assert "Traceback" in failure and "data.corpus" in failure
  assert os.path.exists(os.path.join(workdir, sweep.SWEEP_FILE))


def test_rerun_skips_finished_points_and_retries_failed_ones(swept, caplog):
  config, workdir, _, _ = swept
  before = {n: os.path.getmtime(os.path.join(workdir, n, "metrics.jsonl"))
            for n in ("pairs2", "pairs4")}
  # In subprocesses this time: the failing point's launch.py exits non-zero.
  with caplog.at_level(logging.INFO, logger="experiments.sweep"):
    status = sweep.run_sweep(config, "bad", workdir, parallel=2, flags=STEPS)
  assert status == {"pairs2": "skipped", "bad": "failed", "pairs4": "skipped"}
  said = [r.getMessage() for r in caplog.records if r.name.startswith("experiments.sweep")]
  # Issue 46 item 8: said up front, before the first point starts.
  assert said[0] == "sweep: 2 of 3 points already finished, skipped: pairs2, pairs4", said
  assert before == {n: os.path.getmtime(os.path.join(workdir, n, "metrics.jsonl"))
                    for n in before}
  with open(os.path.join(workdir, "bad", sweep.FAILED)) as f:
    failure = f.read()
  assert "exit code: 1" in failure and "data.corpus" in failure


def test_emitted_commands_reproduce_each_point(swept, tmp_path):
  config, workdir, _, _ = swept
  lines = sweep_launch.emit_commands(config, "bad", workdir, STEPS).splitlines()
  assert len(lines) == 3
  for point, line in zip(sweep.points(config, "bad"), lines):
    argv = shlex.split(line)
    assert argv[argv.index("--workdir") + 1] == os.path.join(workdir, point.name)
    assert argv[argv.index("--config") + 1] == f"{config}:bad"
    flags = [a for a in argv if a.startswith("--config.")]
    rebuilt = sweep.load_module(config).get_config("bad")
    for path, value in sweep.parse_flags(rebuilt, flags).items():
      sweep.set_value(rebuilt, path, value)
    assert rebuilt.to_dict() == sweep.point_config(config, "bad", point, STEPS).to_dict()
  script = sweep_launch.slurm_script(config, "bad", workdir, STEPS)
  assert "#SBATCH --array=0-2" in script
  assert script.count(" ;;") == 4 and lines[1] in script  # 3 points + the error case.
  path = tmp_path / "sweep.sbatch"
  path.write_text(script)
  subprocess.run(["bash", "-n", str(path)], check=True)  # Valid shell.


def test_bad_sweeps_and_overrides_raise_clear_errors(tmp_path):
  config = tmp_path / "dupes.py"
  config.write_text("from experiments.configs.base import get_config\n"
                    "def sweep(arg=None):\n  return [{'name': 'a'}, {'name': 'a'}]\n")
  with pytest.raises(ValueError, match="unique"):
    sweep.points(str(config), None)
  c = sweep.load_module(str(config)).get_config("smoke")
  with pytest.raises(ValueError, match="config.model.num_kv_head"):
    sweep.set_value(c, "model.num_kv_head", 2)
  with pytest.raises(ValueError, match="config.train.steps"):
    sweep.parse_flags(c, ["--config.train.steps=two"])
  assert sweep.parse_flags(c, ["--config.eval.context_lengths=(1,2)",
                               "--config.train.tensorboard", "--config.model.head_dim=8"]) == {
      "eval.context_lengths": (1, 2), "train.tensorboard": True, "model.head_dim": 8}


def test_a_sweep_refuses_every_invalid_point_at_once_before_training_any(tmp_path,
                                                                         monkeypatch, capsys):
  import launch as launch_module  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(launch_module, "main", functools.partial(
      launch_module.main_with_messages, run_main=launch_module.main))
  config = tmp_path / "failing.py"
  config.write_text(FAILING)
  workdir = tmp_path / "runs"
  with pytest.raises(SystemExit) as exit_:  # As a shell, CI or SLURM runs it.
    launch("--config", str(config), "--workdir", str(workdir), "--sweep", *STEPS)
  assert exit_.value.code == 1
  err = [l for l in capsys.readouterr().err.splitlines() if l.startswith("error:")]
  assert len(err) == 1, err  # Refused once, every invalid point named.
  assert err[0].startswith("error: 4 of 5 sweep points are invalid, nothing was trained")
  assert "kv3: ModelConfig" in err[0] and "num_kv_heads" in err[0]
  assert "typo: config.model.num_kv_head: no such field" in err[0]
  assert "legl-s0, legl-s1: config.data.mixture='man:0.7,legl:0.3': 'legl' is not a " \
         "dataset named in data.datasets (man, legal)" in err[0]  # One error, both points.
  assert not workdir.exists()  # No FAILED files, no sweep.json, "ok" not trained.


def test_a_sweep_with_failed_points_exits_1_and_names_them(tmp_path, capsys):
  config = tmp_path / "failing.py"
  config.write_text(FAILING)
  for name in ("a", "b"):
    (tmp_path / f"{name}.txt").write_text("abc\n")
  workdir = str(tmp_path / "runs")
  with pytest.raises(SystemExit) as exit_:  # As a shell, CI or SLURM runs it.
    sweep.main(str(config), "run", workdir, overrides=STEPS)
  assert exit_.value.code == 1
  out = capsys.readouterr().out
  summary = out[out.index("2 failed"):]
  # Each failed point: its name, its error (the traceback's last line), its FAILED file.
  for name in ("a", "b"):
    assert f"{name}: " in summary and "data.corpus" in summary
    assert os.path.join(workdir, name, sweep.FAILED) in summary
    assert os.path.exists(os.path.join(workdir, name, sweep.FAILED))
  assert "report: python -m experiments.report" in out  # Everything else still printed.


def test_preempted_points_are_no_failure(monkeypatch, capsys):
  monkeypatch.setattr(sweep, "run_sweep", lambda *a, **k: {"a": "done", "b": "preempted",
                                                           "c": "pending"})
  assert sweep.main("unused.py", None, "runs/x")["b"] == "preempted"  # No SystemExit.
  assert "failed" not in capsys.readouterr().out


def test_last_error_of_a_failed_file():
  traceback_text = ("Traceback (most recent call last):\n  File \"x.py\", line 1\n"
                    "    raise ValueError('bad')\nValueError: bad\n  second line of it\n")
  assert sweep.last_error(traceback_text) == "ValueError: bad"
  # A --sweep_parallel point's FAILED holds its log's tail, which may go on after it.
  parallel = ("command: python launch.py\nexit code: 1\n\nlast lines of sweep.log:\n"
              + traceback_text + "I0101 absl: shutting down\n")
  assert sweep.last_error(parallel) == "ValueError: bad"
  assert sweep.last_error("killed\n\n") == "killed"


def test_evaluation_points_train_nothing_and_are_report_rows(tmp_path):
  config = str(tmp_path / "two_points.py")
  with open(config, "w") as f:
    f.write(CONFIG)
  workdir = str(tmp_path / "runs")
  out = launch("--config", f"{config}:evals", "--workdir", workdir, "--sweep", *STEPS)
  for name in ("pairs2-at2L", "pairs2-more"):
    run_dir = os.path.join(workdir, name)
    assert sorted(os.listdir(run_dir)) == ["config.json", "metrics.jsonl"]  # No checkpoints.
    (line,) = read_metrics(run_dir)
    assert line["split"] == "eval" and line["step"] == 2
    assert f"{name}  done" in out
  assert "loss@32" in read_metrics(os.path.join(workdir, "pairs2-at2L"))[0]
  assert not os.path.exists(os.path.join(workdir, "pairs2", "evals.jsonl"))  # Source untouched.
  again = launch("--config", f"{config}:evals", "--workdir", workdir, "--sweep", *STEPS)
  assert "pairs2-at2L  skipped" in again and "pairs2-more  skipped" in again
  from experiments import report  # pylint: disable=g-import-not-at-top
  _, rows, fields = report.collect(workdir)
  by_run = {r["run"]: r for r in rows}
  assert by_run["pairs2-at2L"]["status"] == "finished" and "eval.batches" in fields
  with pytest.raises(ValueError, match="only eval.* fields"):
    sweep_eval_check = [{"name": "a"}, {"name": "b", "eval_of": "a", "train.lr": 1.0}]
    from experiments.sweep.points import resolve  # pylint: disable=g-import-not-at-top
    resolve("x.py", [sweep.Point(p.pop("name"), p, p.pop("eval_of", None))
                     for p in sweep_eval_check])

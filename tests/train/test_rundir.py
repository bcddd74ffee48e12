"""A run directory is a lab notebook: no fault or mistake through launch.py may lose
it or make it lie (docs/training.md, "Resuming and failures")."""

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time

import pytest

from tests.cli import launch, launch_cmd, run_cli
from train import load_run
from train.loop import NonFiniteError
from train.metrics import read_metrics
from train.lifecycle.lock import LOCK_FILE, LockError

FAST = ("--config.train.async_checkpoint=False", "--config.train.tensorboard=False",
        "--config.train.log_every=1", "--config.train.eval_every=2",
        "--config.train.checkpoint_every=2")


def train(workdir, *flags):
  return launch("--workdir", str(workdir), *FAST, *flags)


def snapshot(workdir) -> dict:
  """Every file under the run with its bytes: the run's whole record."""
  out = {}
  for root, _, files in os.walk(workdir):
    for f in files:
      path = os.path.join(root, f)
      with open(path, "rb") as fh:
        out[os.path.relpath(path, workdir)] = fh.read()
  return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A finished 4-step run with checkpoints at 2 and 4; tests copy it to change it."""
  workdir = tmp_path_factory.mktemp("trained") / "run"
  train(workdir, "--config.train.steps=4")
  return workdir


@pytest.fixture
def copy(trained, tmp_path):
  dst = tmp_path / "run"
  shutil.copytree(trained, dst)
  return dst


def test_nonfinite_stop_keeps_the_checkpoint_it_names_and_says_so(tmp_path, caplog):
  """Async saves finish on the error path, up to the interpreter's exit (a subprocess);
  the log says fresh vs resumed (INFO; the rerun in this process)."""
  args = ("--workdir", str(tmp_path), "--config.train.lr=1e6", "--config.train.steps=8",
          "--config.train.checkpoint_every=2", "--config.train.warmup_steps=0",
          "--config.train.tensorboard=False")
  first = run_cli(*args)
  assert first.returncode != 0
  assert "the last good checkpoint is step 2" in first.stderr
  assert "cannot schedule new futures" not in first.stderr
  assert "fresh at step 0" in first.stderr
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2"]  # Finalised, no *-tmp.
  with caplog.at_level(logging.INFO), pytest.raises(NonFiniteError, match="non-finite"):
    launch(*args)
  assert "resuming" in caplog.text and "from step 2" in caplog.text
  assert load_run(str(tmp_path)).step == 2


def test_verbosity_flag_hides_info(copy):
  quiet = run_cli("--workdir", str(copy), *FAST, "--config.train.steps=4", "--verbosity=-1")
  assert quiet.returncode == 0 and "nothing to train" in quiet.stdout
  assert "nothing to train" not in quiet.stderr  # The INFO line is hidden.


def test_eval_mode_evaluates_without_training_or_touching_the_run(copy):
  # What attention_impl="auto" ran at each length is a recorded fact of the run.
  assert json.load(open(copy / "config.json"))["_run"]["attention_impl"] == {"32": "xla"}
  before = snapshot(copy)
  out = launch("--mode", "eval", "--workdir", str(copy))
  assert "step 4" in out and "loss" in out and "bpb" in out
  out = launch("--mode", "eval", "--workdir", str(copy), "--step", "2",
               "--config.eval.batches=1", "--config.eval.context_lengths=(1,2)")
  after = snapshot(copy)
  evals = [json.loads(line) for line in after.pop("evals.jsonl").decode().splitlines()]
  assert after == before  # metrics.jsonl, checkpoints and config.json untouched.
  assert [e["step"] for e in evals] == [4, 2]
  assert evals[1]["overrides"] == {"eval.batches": 1, "eval.context_lengths": [1, 2]}
  assert "loss@64" in evals[1] and "loss@64" not in evals[0]
  assert load_run(str(copy)).evals == evals
  with pytest.raises(ValueError, match="only --config.eval"):
    launch("--mode", "eval", "--workdir", str(copy), "--config.train.lr=0.1")


def test_a_second_trainer_is_refused_and_a_dead_ones_lock_is_taken_over(copy):
  proc = subprocess.Popen(launch_cmd("--workdir", str(copy), *FAST, "--config.train.steps=5000",
                                     "--config.train.checkpoint_every=1000"),
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    deadline = time.time() + 240
    while max((r["step"] for r in read_metrics(copy)), default=0) < 5:
      assert proc.poll() is None and time.time() < deadline, "trainer did not start"
      time.sleep(0.2)
    lines = len(read_metrics(copy))
    with pytest.raises(LockError, match=f"in use by another trainer: pid {proc.pid}"):
      train(copy, "--config.train.steps=5000")
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  assert len(read_metrics(copy)) >= lines  # The refused trainer wrote nothing.
  holder = json.load(open(copy / LOCK_FILE))
  assert holder["pid"] == proc.pid  # Killed: the lock is stale.
  out = train(copy, "--config.train.steps=4")  # Takes the stale lock, then finds no work.
  assert "nothing to train" in out and not os.path.exists(copy / LOCK_FILE)


def test_a_lock_from_another_host_is_refused_with_how_to_clear_it(copy):
  before = snapshot(copy)
  with open(copy / LOCK_FILE, "w") as f:
    json.dump({"host": "not-" + socket.gethostname(), "pid": 1, "since": "then"}, f)
  with pytest.raises(LockError, match=f"delete {copy / LOCK_FILE}"):
    train(copy, "--config.train.steps=6")
  os.remove(copy / LOCK_FILE)
  assert snapshot(copy) == before


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_logged_history_without_a_checkpoint_is_refused(copy, damage):
  if damage == "missing":
    shutil.rmtree(copy / "checkpoints")
  else:
    for root, _, files in os.walk(copy / "checkpoints"):
      for f in files:
        if not f.startswith("_"):
          open(os.path.join(root, f), "wb").write(b"garbage")
  metrics = (copy / "metrics.jsonl").read_bytes()
  with pytest.raises(ValueError, match="records 6 lines up to step 4.*new --workdir") as e:
    train(copy, "--config.train.steps=4")
  assert (copy / "metrics.jsonl").read_bytes() == metrics
  if damage == "missing":  # Told apart from a run killed before its first save.
    assert "checkpoints.jsonl records committed saves at steps [2, 4]" in str(e.value)


def test_a_run_from_before_the_record_of_saves_is_refused_not_restarted(copy):
  """Without checkpoints.jsonl (older runs) lost checkpoints cannot be told from none."""
  shutil.rmtree(copy / "checkpoints")
  os.remove(copy / "checkpoints.jsonl")
  record = json.loads((copy / "config.json").read_text())
  del record["_run"]["saves_log"]
  (copy / "config.json").write_text(json.dumps(record))
  with pytest.raises(ValueError, match="config.json predates checkpoints.jsonl"):
    train(copy, "--config.train.steps=4")


def test_every_refusal_exits_nonzero_with_no_thread_outliving_it(copy):
  """The refusal that remains (checkpoints deleted after committed saves), 20 times in a
  subprocess: exit status 1 each time, and no orbax thread racing the interpreter's exit."""
  shutil.rmtree(copy / "checkpoints")
  cmd = launch_cmd("--workdir", str(copy), *FAST, "--config.train.steps=4")
  done = [run_cli(cmd=cmd, timeout=120) for _ in range(20)]  # One at a time: the LOCK.
  assert [d.returncode for d in done] == [1] * 20, [d.stderr[-800:] for d in done]
  for d in done:
    assert "holds no checkpoint" in d.stderr and "cannot schedule new futures" not in d.stderr
    assert "Traceback" not in d.stderr, d.stderr[-2000:]


def test_changed_config_is_refused_then_recorded_when_deliberate(copy):
  before = snapshot(copy)
  with pytest.raises(ValueError, match=r"train.lr: 0.003 -> 0.001"):
    train(copy, "--config.train.steps=6", "--config.train.lr=0.001")
  assert snapshot(copy) == before
  out = train(copy, "--config.train.steps=2")  # Fewer steps than done: nothing changes.
  assert "nothing to train" in out and snapshot(copy) == before
  train(copy, "--config.train.steps=6", "--config.train.lr=0.001",
        "--config.data.batch_size=16", "--allow_config_change")
  run = load_run(str(copy))
  changes = {c["field"]: (c["step"], c["old"], c["new"]) for c in run.config_changes}
  assert changes["train.lr"] == (4, 0.003, 0.001)
  assert changes["data.batch_size"] == (4, 8, 16)
  assert changes["train.steps"] == (4, 4, 6)
  assert run.config.train.lr == 0.001  # config.json: the settings from step 4 on.
  seen = {r["step"]: r["tokens_seen"] for r in run.metrics if r["split"] == "train"}
  assert seen[4] == 4 * 8 * 32 and seen[6] == 4 * 8 * 32 + 2 * 16 * 32


def test_unrolling_the_layers_on_resume_is_operational_and_recorded(copy):
  """`model.scan_unroll` and the attention blocks change how the step runs, not what it
  computes: a resume may change them without --allow_config_change (a run started
  before the blocks' default became 0 resumes), and the change is on the record."""
  train(copy, "--config.train.steps=6", "--config.model.scan_unroll=4",
        "--config.model.attention_block_q=128")
  run = load_run(str(copy))
  changes = {c["field"]: (c["step"], c["old"], c["new"]) for c in run.config_changes}
  assert changes["model.scan_unroll"] == (4, 1, 4)
  assert changes["model.attention_block_q"] == (4, 0, 128)
  assert run.config.model.scan_unroll == 4
  with pytest.raises(ValueError, match=r"ModelConfig.scan_unroll=0: must be >= 1"):
    train(copy.parent / "new", "--config.model.scan_unroll=0")
  assert not os.path.exists(copy.parent / "new")


def test_remat_outside_the_layer_loop_warns_on_cpu(tmp_path, caplog):
  train(tmp_path / "run", "--config.train.steps=1", "--config.train.warmup_steps=0",
        "--config.model.remat=full", "--config.model.scan_unroll=2")
  assert "model.scan_unroll=2: on CPU the recomputation then saves little memory" in caplog.text


@pytest.mark.parametrize("flag,field", [
    ("--config.train.lr=-0.01", "train.lr"),
    ("--config.data.seq_len=0", "data.seq_len"),
    ("--config.data.batch_size=0", "data.batch_size"),
    ("--config.eval.batch_size=0", "eval.batch_size"),
    ("--config.train.b2=1.5", "train.b2"),
    ("--config.eval.context_lengths=(0,)", "eval.context_lengths"),
])
def test_every_field_is_validated_before_anything_is_written(tmp_path, flag, field):
  with pytest.raises(ValueError, match=f"config.{field}="):
    train(tmp_path / "run", flag)
  assert not os.path.exists(tmp_path / "run")


def test_a_corpus_smaller_than_a_batch_warns(tmp_path, caplog):
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  for i in range(3):  # 3 short documents, one of them held out.
    (corpus / f"{i}.txt").write_text("to be or not to be " * 2)
  train(tmp_path / "run", "--config.train.steps=1", "--config.train.warmup_steps=0",
        f"--config.data.corpus={corpus}")
  assert "the train split has" in caplog.text and "fewer than one batch" in caplog.text


def test_reading_a_run_never_changes_it(copy, tmp_path, caplog):
  empty = tmp_path / "empty"
  empty.mkdir()
  (empty / "config.json").write_bytes((copy / "config.json").read_bytes())
  with pytest.raises(FileNotFoundError, match="no checkpoint"):
    launch("--mode", "generate", "--workdir", str(empty), "--prompt", "ROMEO:")
  assert sorted(os.listdir(empty)) == ["config.json"]  # No checkpoints/ created.
  latest = copy / "checkpoints" / "4" / "state"
  for root, _, files in os.walk(latest):
    for f in files:
      if not f.startswith("_"):
        open(os.path.join(root, f), "wb").write(b"garbage")
  before = snapshot(copy)
  assert load_run(str(copy)).step == 2  # Falls back to the previous checkpoint...
  assert "step 4 failed to restore" in caplog.text
  assert snapshot(copy) == before  # ...and moves nothing.


def test_profile_steps_write_a_trace_into_the_run(tmp_path):
  train(tmp_path / "run", "--config.train.steps=4", "--config.train.profile_steps=2",
        "--config.train.profile_start=2")
  traces = [f for _, _, files in os.walk(tmp_path / "run" / "profile") for f in files
            if f.endswith(".xplane.pb")]
  assert traces, "no jax.profiler trace in RUN/profile"


def test_a_run_from_older_code_without_newer_fields_still_evaluates(copy):
  record = json.load(open(copy / "config.json"))
  for field in ("profile_steps", "profile_start"):
    del record["train"][field]
  json.dump(record, open(copy / "config.json", "w"))
  out = launch("--mode", "eval", "--workdir", str(copy))
  assert "step 4" in out

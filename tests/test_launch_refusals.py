"""Bad input through launch.py ends in one message naming the file and the problem, never
a raw traceback (issue 28, item 5)."""

import functools
import json
import os

import pytest

from tests.cli import launch, run_cli


def test_a_missing_config_file_is_one_line_from_the_command_line():
  missing = os.path.join("experiments", "configs", "nope.py")
  done = run_cli("--config", missing, timeout=120)
  assert done.returncode == 1
  assert f"error: --config {missing}: no such config file" in done.stderr
  assert "Traceback" not in done.stderr, done.stderr[-2000:]


def test_a_config_error_prints_its_message_not_a_traceback(tmp_path, monkeypatch, capsys):
  """launch.py's __main__ runs main_with_messages (the same in-process here)."""
  import launch as launch_module  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(launch_module, "main", functools.partial(
      launch_module.main_with_messages, run_main=launch_module.main))
  with pytest.raises(SystemExit) as exit_info:
    launch("--config.train.lr=-1", "--workdir", str(tmp_path / "r"))
  assert exit_info.value.code == 1
  err = capsys.readouterr().err
  assert "error: config.train.lr=-1.0: must be a finite number" in err
  assert "Traceback" not in err
  assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("text, said", [
    ("{not json", "is not valid JSON"),
    ('{"architectures": ["LlamaForCausalLM"], "hidden_size": "sixty-four", '
     '"num_attention_heads": 4, "num_hidden_layers": 1, "vocab_size": 8, '
     '"intermediate_size": 8}', r"HF config.hidden_size='sixty-four': is a str; it must be an "
                                 "integer"),
    ("[" * 200_000 + "]" * 200_000, r"is not valid JSON \(RecursionError"),
])
def test_import_of_a_malformed_config_json_names_it(tmp_path, text, said):
  hf_dir = tmp_path / "hf"
  hf_dir.mkdir()
  (hf_dir / "config.json").write_text(text)
  with pytest.raises(ValueError, match=f"{hf_dir / 'config.json'}.*{said}|{said}"):
    launch("--mode", "import", "--hf_dir", str(hf_dir), "--workdir", str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name, text, said", [
    ("tokenizer.json", '{"model": {"type": "BPE", "vocab": 7}}',
     "is not a tokenizer.json the tokenizers library reads"),
    ("tokenizer_config.json", "{" + '"a":{' * 100_000 + "}" * 100_001,
     r"tokenizer_config\.json is not valid JSON \(RecursionError"),
])
def test_a_malformed_hf_tokenizer_file_is_named(tmp_path, name, text, said):
  pytest.importorskip("tokenizers")
  tok = tmp_path / "tok"
  tok.mkdir()
  (tok / "tokenizer.json").write_text(json.dumps({
      "version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1},
                                  "unk_token": "a"}}))
  (tok / name).write_text(text)
  with pytest.raises(ValueError, match=said):
    launch("--workdir", str(tmp_path / "run"), f"--config.data.tokenizer=hf:{tok}/tokenizer.json",
           "--config.data.vocab_size=2", "--config.model.vocab_size=256")
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("config", [(), ("--config", "experiments/configs/tiny.py:smoke")])
def test_a_misspelt_override_is_one_line_with_the_suggestion(tmp_path, config):
  """Without --config ml_collections applies overrides as launch.py is imported, with one
  in absl's flag parsing: both end in the same line, before anything is imported or run."""
  import sys  # pylint: disable=g-import-not-at-top
  from tests.cli import ROOT  # pylint: disable=g-import-not-at-top
  done = run_cli(cmd=[sys.executable, os.path.join(ROOT, "launch.py"), *config,
                     "--config.train.step=50", "--workdir", str(tmp_path / "r")],
                 timeout=120, cwd=ROOT)
  assert done.returncode == 1
  assert ("error: --config.train.step=50: config.train has no field 'step'; did you mean "
          "config.train.steps?") in done.stderr
  assert "Traceback" not in done.stderr and "AttributeError" not in done.stderr
  assert not (tmp_path / "r").exists()


def _with_messages(monkeypatch):
  import launch as launch_module  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(launch_module, "main", functools.partial(
      launch_module.main_with_messages, run_main=launch_module.main))


def test_a_missing_eval_corpus_is_named_before_anything_is_written(tmp_path, monkeypatch,
                                                                   capsys):
  _with_messages(monkeypatch)
  missing = str(tmp_path / "held" / "*.txt")
  with pytest.raises(SystemExit):
    launch(f"--config.eval.corpora=held={missing}", "--workdir", str(tmp_path / "r"))
  err = capsys.readouterr().err
  assert f"error: config.eval.corpora: held={missing!r}: pattern matches no files" in err
  assert not (tmp_path / "r").exists()  # No config.json, checkpoints/, tokenizer/.


def test_a_refused_mode_says_its_one_line_without_the_help(tmp_path, monkeypatch, capsys):
  _with_messages(monkeypatch)
  with pytest.raises(SystemExit) as exit_info:
    launch("--mode", "export", "--workdir", str(tmp_path / "r"))
  assert exit_info.value.code == 1
  captured = capsys.readouterr()
  assert "error: --mode export needs --workdir RUN and --hf_dir OUT" in captured.err
  # main_with_messages ends it: absl's app.run never sees the UsageError, whose handler
  # printed the module's whole docstring (--help) first.
  assert "python launch.py" not in captured.out + captured.err


@pytest.mark.parametrize("how", ["abort", "shell"])
def test_a_crash_fails_the_test_with_the_command_never_reads_as_a_refusal(how):
  """Issue 43: XLA's CHECK failures abort the process (exit 134 from a shell, -6 here):
  `run_cli` fails the test naming the command and its last lines, whatever exit status
  the test then expected of a refusal."""
  import sys  # pylint: disable=g-import-not-at-top
  program = "print('F hlo_instruction.cc:1615] Invalid binary', flush=True); import os; os.abort()"
  cmd = [sys.executable, "-c", program]
  if how == "shell":
    cmd = ["bash", "-c", f"{sys.executable} -c \"{program}\"; exit $?"]
  with pytest.raises(pytest.fail.Exception) as failed:
    run_cli(cmd=cmd, timeout=60)
  said = str(failed.value)
  assert "crashed (exit " in said and "not a refusal" in said
  assert "-c" in said and "Invalid binary" in said


@pytest.mark.parametrize("arg, said", [
    ("tiny.py:smok", "config argument 'smok' (in 'smok') is not one of this config's arguments"),
    ("tiny.py:smoke=flase", "config argument smoke='flase': expected a boolean"),
    ("gqa_ablation.py:seed=2", "config argument 'seed' (in 'seed=2') is not one of"),
])
def test_a_config_argument_typo_is_one_line_without_a_traceback(tmp_path, arg, said):
  """Issue 46 item 7: get_config's error inside absl's flag parsing, as one line."""
  import sys  # pylint: disable=g-import-not-at-top
  from tests.cli import ROOT  # pylint: disable=g-import-not-at-top
  config = os.path.join("experiments", "configs", arg)
  done = run_cli(cmd=[sys.executable, os.path.join(ROOT, "launch.py"), "--config", config,
                      "--workdir", str(tmp_path / "r")], timeout=120, cwd=ROOT)
  assert done.returncode == 1
  assert f"error: --config={config}: {said}" in done.stderr, done.stderr
  assert "Traceback" not in done.stderr and "FATAL" not in done.stderr
  assert len(done.stderr.strip().splitlines()) == 2, done.stderr  # The error, the hint.
  assert not (tmp_path / "r").exists()

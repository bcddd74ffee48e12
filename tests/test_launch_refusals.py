"""Bad input through launch.py ends in one message naming the file and the problem, never
a raw traceback (issue 28, item 5)."""

import functools
import json
import os
import subprocess

import pytest

from tests.cli import launch, launch_cmd


def test_a_missing_config_file_is_one_line_from_the_command_line():
  missing = os.path.join("experiments", "configs", "nope.py")
  done = subprocess.run(launch_cmd("--config", missing), capture_output=True, text=True,
                        timeout=120)
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
     '"intermediate_size": 8}', "not a config this importer reads"),
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

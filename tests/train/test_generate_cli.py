"""`launch.py --mode generate` as a user runs it: a prompt that is not UTF-8 and a
max_new_tokens whose KV cache cannot fit fail at once, with messages that name the flag."""

import time

import pytest

from model.decode import cache as kv_cache
from train import decode_memory
from tests.cli import launch
from train import load_run
from train.generate import generate, generate_main

HUGE = 10**12  # Tokens: a cache of about a petabyte for the smoke model.


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """The smoke config trained for 2 steps: the cheapest run that generate can load."""
  d = str(tmp_path_factory.mktemp("generate") / "run")
  launch("--workdir", d, "--config.train.steps=2", "--config.train.async_checkpoint=False",
         "--config.train.tensorboard=False", "--config.train.checkpoint_every=2",
         "--config.train.eval_every=2")
  return d


def test_generate_continues_a_prompt(run_dir):
  out = launch("--mode", "generate", "--workdir", run_dir, "--prompt", "ROMEO:",
               "--max_new_tokens", "4")
  assert out.startswith("ROMEO:") and "tokens/s" in out


def test_prompt_that_is_not_utf8_is_refused_naming_the_byte(run_dir, tmp_path):
  # Bytes b"RO\xffMEO" on a UTF-8 command line reach sys.argv as "RO\udcffMEO" (PEP 383).
  with pytest.raises(ValueError, match=r"--prompt is not valid UTF-8: byte 0xff at byte 2 "
                     r"\(character 2, after 'RO'\)"):
    launch("--mode", "generate", "--workdir", run_dir, "--prompt", "RO\udcffMEO")
  # Checked before the run is read: an empty directory would fail to load after it.
  t0 = time.perf_counter()
  with pytest.raises(ValueError, match=r"--prompt is not valid UTF-8: lone surrogate"):
    generate_main(str(tmp_path), "ok \ud800")
  assert time.perf_counter() - t0 < 1


def test_max_new_tokens_whose_cache_cannot_fit_is_refused_before_compiling(run_dir):
  with pytest.raises(ValueError) as e:
    launch("--mode", "generate", "--workdir", run_dir, "--prompt", "ROMEO:",
           "--max_new_tokens", str(HUGE))
  message = str(e.value)
  assert "--max_new_tokens=1,000,000,000,000" in message
  assert "GiB" in message and "is free" in message and "largest max_new_tokens" in message
  # The Python API refuses too, without compiling (the run is already loaded here).
  run = load_run(run_dir)
  t0 = time.perf_counter()
  with pytest.raises(ValueError, match="KV cache"):
    generate(run.model_config, run.variables, [[1, 2, 3]], HUGE)
  assert time.perf_counter() - t0 < 10


def test_largest_max_new_tokens_named_in_the_refusal_fits(run_dir, monkeypatch):
  cfg = load_run(run_dir).model_config
  free = kv_cache.cache_bytes(cfg, 2, 100) + 5  # Room for 100 slots and a little more.
  monkeypatch.setattr(decode_memory, "available_bytes", lambda device=None: (free, "test memory"))
  decode_memory.check_cache_memory(cfg, 2, 7, 94)  # 7 + 94 - 1 = 100 slots.
  with pytest.raises(ValueError, match=r"largest max_new_tokens whose cache fits is 94 "):
    decode_memory.check_cache_memory(cfg, 2, 7, 95)
  with pytest.raises(ValueError, match="not even the prompt's cache fits"):
    decode_memory.check_cache_memory(cfg, 2, 102, 1)

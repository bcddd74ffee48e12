"""The roofline's cost probes (train/aot/compile.py probe_train_cost) with a fake compile:
CPU only, no libtpu.

Property: a scanned loss is counted as one chunk by XLA; the probes at n and 2n chunks
recover n chunks' FLOPs exactly for a cost linear in the chunk's tokens (and the bytes
but for the per-chunk constant, counted once), with the layers extrapolated as before;
a probe that does not compile gives no estimate rather than a wrong one.
"""

import types

import jax

from experiments.configs import pod
from train import loss
from train.aot import compile as aot_compile
from train.lifecycle import session
from train.spec import read

CHUNKS, TOKENS = 8, 32 * 64  # The loss's chunks and the step's tokens (fake).


def _cost(layers: int, chunk_tokens: float) -> dict[str, float]:
  """Layers: affine in their count; the loss counted once, at one chunk's tokens."""
  return {"flops": 5.0 + layers * 3.0 + 11.0 * chunk_tokens,
          "bytes accessed": 100.0 + layers * 50.0 + 40.0 + 0.5 * chunk_tokens}


def _fake_compile(fits):
  asked = []

  def compile_train(config, lay):
    del lay
    scale, seen = loss._PROBE  # pylint: disable=protected-access
    seen.append(CHUNKS)
    layers = int(config.model.num_layers)
    asked.append((layers, scale))
    executable = types.SimpleNamespace(
        cost_analysis=lambda: _cost(layers, TOKENS / (CHUNKS * scale)))
    return types.SimpleNamespace(executable=executable if fits(layers, scale) else None)
  return compile_train, asked


def _setup():
  config = pod.get_config("preset=1b,smoke")
  config.mesh.update(data=8, fsdp=1)
  return config, session.open_run(read(config), None, "compile", jax.devices())


def test_the_chunked_loss_is_counted_once_per_chunk(monkeypatch):
  config, lay = _setup()
  fake, asked = _fake_compile(lambda layers, scale: True)
  monkeypatch.setattr(aot_compile, "compile_train", fake)
  got = aot_compile.probe_train_cost(config, lay, jax.devices())
  n = int(config.model.num_layers)
  assert got["flops"] == 5.0 + n * 3.0 + 11.0 * TOKENS  # Every chunk: exact.
  assert got["bytes_accessed"] == 100.0 + n * 50.0 + 40.0 + 0.5 * TOKENS  # Constant once.
  assert got["loss_chunks"] == CHUNKS
  assert sorted(asked) == [(1, 1), (1, 2), (2, 1)]


def test_a_probe_that_does_not_compile_gives_no_estimate(monkeypatch):
  config, lay = _setup()
  for fits in (lambda layers, scale: scale == 1, lambda layers, scale: layers == 1):
    fake, _ = _fake_compile(fits)
    monkeypatch.setattr(aot_compile, "compile_train", fake)
    assert aot_compile.probe_train_cost(config, lay, jax.devices()) is None

"""The roofline's cost probes (train/aot/compile.py probe_train_cost) with a fake compile:
CPU only, no libtpu.

Property: a probe that does not fit at the step's batch (the 1b preset's unrolled loss
chunks at 8 x 4096 per chip on v5e) is compiled at 1/2 and 1/4 of it, and for a cost
affine in the batch and in the layers the extrapolation is exact; one that fits at no
batch gives no estimate rather than a wrong one.
"""

import types

import jax

from experiments.configs import pod
from train.aot import compile as aot_compile
from train.lifecycle import session
from train.validation import model_config


def _cost(layers: int, batch: int) -> dict[str, float]:
  return {"flops": 5.0 + 11.0 * batch + layers * (3.0 + 7.0 * batch),
          "bytes accessed": 100.0 + 2.0 * batch + layers * (50.0 + 0.5 * batch)}


def _fake_compile(fits):
  asked = []

  def compile_train(config, lay):
    del lay
    layers, batch = int(config.model.num_layers), int(config.data.batch_size)
    asked.append(batch)
    executable = types.SimpleNamespace(cost_analysis=lambda: _cost(layers, batch))
    return types.SimpleNamespace(executable=executable if fits(batch) else None)
  return compile_train, asked


def _setup():
  config = pod.get_config("preset=1b,smoke")
  config.data.batch_size = 32
  config.mesh.update(data=8, fsdp=1)
  lay = session.layout(config, model_config(config), jax.devices())
  return config, lay


def test_an_out_of_memory_probe_is_extrapolated_exactly_from_smaller_batches(monkeypatch):
  config, lay = _setup()
  fake, asked = _fake_compile(lambda b: b < 32)
  monkeypatch.setattr(aot_compile, "compile_train", fake)
  got = aot_compile.probe_train_cost(config, lay, jax.devices())
  want = _cost(int(config.model.num_layers), 32)
  assert got["flops"] == want["flops"]
  assert got["bytes_accessed"] == want["bytes accessed"]
  assert got["probe_batch_fraction"] == 0.5
  assert sorted(set(asked)) == [8, 16, 32]


def test_a_probe_that_fits_is_taken_as_it_is_and_none_that_fits_gives_no_estimate(
    monkeypatch):
  config, lay = _setup()
  fake, asked = _fake_compile(lambda b: True)
  monkeypatch.setattr(aot_compile, "compile_train", fake)
  got = aot_compile.probe_train_cost(config, lay, jax.devices())
  assert got["flops"] == _cost(int(config.model.num_layers), 32)["flops"]
  assert got["probe_batch_fraction"] == 1.0 and set(asked) == {32}
  fake, _ = _fake_compile(lambda b: False)
  monkeypatch.setattr(aot_compile, "compile_train", fake)
  assert aot_compile.probe_train_cost(config, lay, jax.devices()) is None

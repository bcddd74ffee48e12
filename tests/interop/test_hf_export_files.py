"""export_hf_dir's file layout: sharded safetensors with an index past max_shard_size (as
transformers writes them), one model.safetensors below it, generation_config.json."""

import json
import os

import numpy as np
import pytest

from interop import export_hf_dir
from interop.hf import read_hf_tensors, read_safetensors
from model import ModelConfig
from tests.interop.test_hf_weights import init

CFG = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  mlp_dim=48, max_seq_len=32)


@pytest.fixture(scope="module")
def variables():
  params, state = init(CFG)
  return {"params": params, **state}


def test_shards_past_max_shard_size_and_the_index_maps_every_tensor(variables, tmp_path):
  whole = read_hf_tensors(export_hf_dir((CFG, variables), str(tmp_path / "one")))
  out = str(tmp_path / "sharded")
  export_hf_dir((CFG, variables), out, max_shard_size=16_000)
  with open(os.path.join(out, "model.safetensors.index.json")) as f:
    index = json.load(f)
  files = sorted(set(index["weight_map"].values()))
  assert len(files) >= 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
  assert sorted(index["weight_map"]) == sorted(whole)
  assert index["metadata"]["total_size"] == sum(t.nbytes for t in whole.values())
  for file in files:  # Every tensor lies in the shard the index names.
    names = set(read_safetensors(os.path.join(out, file)))
    assert names == {k for k, v in index["weight_map"].items() if v == file}
  assert not os.path.exists(os.path.join(out, "model.safetensors"))
  back = read_hf_tensors(out)
  assert all(np.array_equal(back[k], whole[k]) for k in whole)
  with open(os.path.join(out, "generation_config.json")) as f:
    assert json.load(f) == {}  # No tokenizer, no overrides: no ids are known.


def test_reexport_replaces_stale_shards(variables, tmp_path):
  out = str(tmp_path / "out")
  export_hf_dir((CFG, variables), out, max_shard_size=16_000)
  export_hf_dir((CFG, variables), out, hf_overrides={"eos_token_id": 2, "bos_token_id": 1})
  assert sorted(f for f in os.listdir(out) if "safetensors" in f) == ["model.safetensors"]
  with open(os.path.join(out, "generation_config.json")) as f:
    assert json.load(f) == {"bos_token_id": 1, "eos_token_id": 2}


def test_transformers_loads_the_shards(variables, tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  out = export_hf_dir((CFG, variables), str(tmp_path / "sharded"), max_shard_size=16_000,
                      hf_overrides={"eos_token_id": 2})
  model = transformers.AutoModelForCausalLM.from_pretrained(out)
  whole = read_hf_tensors(export_hf_dir((CFG, variables), str(tmp_path / "one")))
  loaded = model.state_dict()
  for name, x in whole.items():
    assert np.array_equal(loaded[name].to(torch.float32).numpy(), np.asarray(x, np.float32))
  assert model.generation_config.eos_token_id == 2

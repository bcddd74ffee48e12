"""Import a local Hugging Face model directory as a blockwork run, and export back.

    from interop import import_hf_dir, export_hf_dir
    import_hf_dir("llama-dir", "runs/llama")           # config.json + step-0 checkpoint
    export_hf_dir("runs/llama", "llama-out")           # config.json + safetensors (+ tokenizer)

No network and no torch: safetensors files are read and written here with
NumPy (bfloat16 through ml_dtypes), so a bfloat16 checkpoint round-trips too.
"""

from __future__ import annotations

import glob
import json
import math
import os
import shutil
import struct
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from experiments.configs import base
from interop import byte_tokenizer, hf_config, hf_weights
from model.config import ModelConfig
from train import checkpoint
from train import spec as spec_lib
from train.data import tokenizers
from train.io import staging
from train.io.jsonfile import read_json_object
from train.lifecycle.config_record import contents
from train.lifecycle.load import load_run
from train.metrics import progress

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
          "BOOL": np.bool_}
CODES = {np.dtype(v): k for k, v in DTYPES.items()}
PARAM_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


# safetensors -------------------------------------------------------------------------


def _header(path: str, f, size: int) -> tuple[dict, int]:
  """(JSON header, its length) of an open .safetensors file of `size` bytes."""
  if size < 8:
    raise ValueError(f"{path}: truncated: {size} bytes, shorter than the 8-byte header "
                     "length that starts a safetensors file")
  (n,) = struct.unpack("<Q", f.read(8))
  if n > size - 8:
    raise ValueError(f"{path}: truncated or not safetensors: the header length says "
                     f"{n} bytes but only {size - 8} follow it")
  try:
    header = json.loads(f.read(n))
  except ValueError as e:  # JSONDecodeError and UnicodeDecodeError both are.
    raise ValueError(f"{path}: corrupt: the {n}-byte header is not JSON ({e})") from None
  if not isinstance(header, dict):
    raise ValueError(f"{path}: corrupt: the header is a JSON {type(header).__name__}, "
                     "not an object")
  return header, n


def _check_tensor(path: str, name: str, info: Any, data_bytes: int) -> None:
  """The header entry of tensor `name` describes bytes that the file really holds."""
  if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
    raise ValueError(f"{path}: corrupt: tensor {name!r} needs dtype, shape and "
                     f"data_offsets in the header, got {info!r}")
  if info["dtype"] not in DTYPES:
    raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']}, not supported")
  shape, offsets = info["shape"], info["data_offsets"]
  is_int = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0
  if not (isinstance(shape, list) and all(map(is_int, shape))):
    raise ValueError(f"{path}: corrupt: tensor {name!r} has shape {shape!r}")
  if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(is_int, offsets))
          and offsets[0] <= offsets[1]):
    raise ValueError(f"{path}: corrupt: tensor {name!r} has data_offsets {offsets!r}")
  start, end = offsets
  if end > data_bytes:
    raise ValueError(f"{path}: truncated: header says tensor {name!r} ends at byte {end} but "
                     f"the file has {data_bytes} data bytes")
  need = math.prod(shape) * np.dtype(DTYPES[info["dtype"]]).itemsize
  if end - start != need:
    raise ValueError(f"{path}: corrupt: tensor {name!r} has data_offsets {offsets} "
                     f"({end - start} bytes) but shape {shape} of {info['dtype']} needs "
                     f"{need} bytes")


def read_safetensors(path: str) -> dict[str, np.ndarray]:
  """name -> array, memory-mapped (read-only) from one .safetensors file.

  A truncated or corrupt file raises ValueError naming it and what is wrong,
  before any tensor is read.
  """
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    header, n = _header(path, f, size)
  data_bytes = size - 8 - n
  tensors = {k: v for k, v in header.items() if k != "__metadata__"}
  for name, info in tensors.items():
    _check_tensor(path, name, info, data_bytes)
  # mmap refuses an empty range (a file of empty tensors only).
  data = (np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n) if data_bytes
          else np.zeros(0, np.uint8))
  out = {}
  for name, info in tensors.items():
    start, end = info["data_offsets"]
    out[name] = data[start:end].view(DTYPES[info["dtype"]]).reshape(info["shape"])
  return out


def write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
  header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
  offset = 0
  arrays = {k: np.ascontiguousarray(v) for k, v in sorted(tensors.items())}
  for name, x in arrays.items():
    if x.dtype not in CODES:
      raise ValueError(f"tensor {name!r}: dtype {x.dtype} has no safetensors code")
    header[name] = {"dtype": CODES[x.dtype], "shape": list(x.shape),
                    "data_offsets": [offset, offset + x.nbytes]}
    offset += x.nbytes
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # The data starts 8-byte aligned.
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    f.write(struct.pack("<Q", len(blob)) + blob)
    for x in progress(arrays.values(), len(arrays), f"writing {os.path.basename(path)}",
                      unit="tensor"):
      f.write(x.tobytes())
  os.replace(tmp, path)


def read_hf_tensors(hf_dir: str) -> dict[str, np.ndarray]:
  """Every tensor of the checkpoint in `hf_dir` (sharded or not)."""
  index = os.path.join(hf_dir, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
    files = [os.path.join(hf_dir, f) for f in files]
  else:
    files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
  if not files:
    raise FileNotFoundError(f"{hf_dir}: no *.safetensors (PyTorch .bin checkpoints are not "
                            "read: convert them with save_pretrained(safe_serialization=True))")
  out: dict[str, np.ndarray] = {}
  for path in files:
    out.update(read_safetensors(path))
  return out


# Import --------------------------------------------------------------------------------


def read_hf_config(hf_dir: str) -> dict:
  path = os.path.join(hf_dir, "config.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} not found: {hf_dir!r} is not a Hugging Face model dir")
  return read_json_object(path)


def load_hf_dir(hf_dir: str, **overrides: Any) -> tuple[ModelConfig, dict, dict]:
  """(ModelConfig, params, model_state) of an HF model dir; numpy leaves.

  `overrides` set ModelConfig fields that do not change the function, e.g.
  scan_layers, dtype, param_dtype (the weights are cast to it), remat.
  """
  hf = read_hf_config(hf_dir)
  try:
    arch = hf_config.architecture_of(hf)
    cfg = hf_config.from_hf_config(hf, **overrides)
  except (KeyError, TypeError, AttributeError, ValueError) as e:  # A field missing or mistyped.
    what = f"the field {e} is missing" if isinstance(e, KeyError) else f"{e}"
    raise ValueError(f"{os.path.join(hf_dir, 'config.json')}: {what} "
                     f"({type(e).__name__}); it is not a config this importer reads") from None
  params, state = hf_weights.hf_to_variables(read_hf_tensors(hf_dir), cfg, arch,
                                             dtype=PARAM_DTYPES[cfg.param_dtype])
  hf_weights.check_shapes(params, state, cfg)
  return cfg, params, state


def import_hf_dir(hf_dir: str, workdir: str, *, config=None, **overrides: Any) -> ModelConfig:
  """Writes a step-0 blockwork run in `workdir` from the HF model in `hf_dir`.

  `config`: the experiment ConfigDict to start from (default: experiments base);
  its model section is replaced. The tokenizer is copied into the run: a
  SentencePiece `tokenizer.model` (data.tokenizer "sentencepiece"), else a
  `tokenizer.json` with its tokenizer_config.json and the model's end / start
  ids (data.tokenizer "hf"); with neither, the byte tokenizer stays configured.

  A `workdir` that already holds a run is refused (FileExistsError) before
  anything is read or written: the import would replace its config.json, and
  the keep-N checkpoint policy would delete its checkpoints.
  """

  found = contents(workdir)
  if found:
    raise FileExistsError(
        f"{workdir} already holds a run ({'; '.join(found)}); importing {hf_dir} there would "
        "overwrite its config.json and delete its checkpoints. Import into a new --workdir.")
  cfg, params, state = load_hf_dir(hf_dir, **overrides)
  c = config if config is not None else base.get_config()
  c.name = "hf_import"
  c.model.update(cfg.to_dict())
  c.data.seq_len = min(int(c.data.seq_len), cfg.max_seq_len)
  _import_tokenizer(hf_dir, workdir, c)
  as_jax = lambda t: jax.tree.map(jnp.asarray, t)
  checkpoint.save_imported(workdir, spec_lib.read(c), as_jax(params), as_jax(state))
  return cfg


def _import_tokenizer(hf_dir: str, workdir: str, c) -> None:
  """Copies the tokenizer of `hf_dir` into the run and configures `c.data` for it.

  SentencePiece wins when both files exist (Llama 2 dirs ship both, equivalent):
  it is the tokenizer the model was built with.
  """
  spm = os.path.join(hf_dir, "tokenizer.model")
  fast = os.path.join(hf_dir, "tokenizer.json")
  # A bucket run: written into a local stand-in, uploaded as the run's tokenizer/.
  with staging.staged(workdir, os.path.dirname(tokenizers.SPM_FILE)) as root:
    if os.path.isfile(spm):
      os.makedirs(os.path.join(root, os.path.dirname(tokenizers.SPM_FILE)), exist_ok=True)
      shutil.copyfile(spm, os.path.join(root, tokenizers.SPM_FILE))
      c.data.tokenizer = "sentencepiece"
      c.data.vocab_size = tokenizers.SentencePieceTokenizer.load(spm).vocab_size
    elif os.path.isfile(fast):
      tok = tokenizers.HFTokenizer.load(fast)  # Reads hf_dir's config.json for the end id.
      tok.save(os.path.join(root, tokenizers.HF_DIR))
      c.data.tokenizer = "hf"
      c.data.vocab_size = tok.vocab_size


# Export --------------------------------------------------------------------------------


def export_hf_dir(src: Any, out_dir: str, *, architecture: str | None = None,
                  hf_overrides: dict | None = None,
                  max_shard_size: int = 5 * 10**9) -> str:
  """Writes config.json, generation_config.json and safetensors weights that
  transformers' from_pretrained loads, and the run's tokenizer.json (+
  tokenizer_config.json) when it has one.

  `src`: a run directory (its latest checkpoint), or (ModelConfig, variables)
  where variables is {"params": ..., "moe_state": ...} or the params alone.
  `architecture`: the HF class name (default: the simplest family that fits).
  `hf_overrides`: extra config.json fields, e.g. {"eos_token_id": 2}.
  `max_shard_size`: bytes; larger weights are split into model-0000i-of-0000n
  shards with a model.safetensors.index.json (transformers' layout).
  End / start ids: hf_overrides', else the run tokenizer's (when known).
  """
  tokenizer = None
  if isinstance(src, (str, os.PathLike)):
    run = load_run(str(src))
    cfg, variables, tokenizer = run.model_config, run.variables, run.tokenizer
  else:
    cfg, variables = src
  if "params" not in variables:
    variables = {"params": variables}
  hf = hf_config.to_hf_config(cfg, architecture)
  for key, attr in (("eos_token_id", "eos_id"), ("bos_token_id", "bos_id")):
    if getattr(tokenizer, attr, None) is not None:
      hf[key] = int(getattr(tokenizer, attr))
  hf.update(hf_overrides or {})
  arch = hf["architectures"][0]
  state = {k: v for k, v in variables.items() if k != "params"}
  tensors = hf_weights.variables_to_hf(variables["params"], state, cfg, arch)
  os.makedirs(out_dir, exist_ok=True)
  write_hf_tensors(out_dir, tensors, max_shard_size)
  generation = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                if hf.get(k) is not None}
  for name, obj in (("config.json", hf), ("generation_config.json", generation)):
    with open(os.path.join(out_dir, name), "w") as f:
      json.dump(obj, f, indent=2, sort_keys=True)
  if isinstance(src, (str, os.PathLike)):
    _export_tokenizer(str(src), out_dir)
    if tokenizer is not None and tokenizer.identity()[0] == "byte":
      byte_tokenizer.write_files(out_dir, cfg.max_seq_len)
  return out_dir


def write_hf_tensors(out_dir: str, tensors: dict[str, np.ndarray],
                     max_shard_size: int = 5 * 10**9) -> list[str]:
  """model.safetensors, or shards + index past `max_shard_size` bytes; the file names.

  Shards are filled in name order up to `max_shard_size` (a tensor larger than
  that gets a shard of its own). Weights of an earlier export in `out_dir` are
  removed first: transformers prefers model.safetensors to an index, so a stale
  one would be loaded instead of the new shards.
  """
  stale = glob.glob(os.path.join(out_dir, "model-*-of-*.safetensors")) + [
      os.path.join(out_dir, n) for n in ("model.safetensors", "model.safetensors.index.json")]
  for path in stale:
    if os.path.isfile(path):
      os.remove(path)
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name in sorted(tensors):
    nbytes = np.asarray(tensors[name]).nbytes
    if shards[-1] and size + nbytes > max_shard_size:
      shards.append({})
      size = 0
    shards[-1][name] = tensors[name]
    size += nbytes
  if len(shards) == 1:
    write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors)
    return ["model.safetensors"]
  names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
  weight_map = {}
  for file, shard in zip(names, shards):
    write_safetensors(os.path.join(out_dir, file), shard)
    weight_map.update(dict.fromkeys(shard, file))
  total = sum(np.asarray(t).nbytes for t in tensors.values())
  with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  return names


def _export_tokenizer(workdir: str, out_dir: str) -> None:
  """The run's tokenizer.json (+ tokenizer_config.json), as transformers reads them;
  a SentencePiece run's model as `_export_spm_tokenizer` writes it."""
  with staging.staged(workdir, tokenizers.HF_DIR) as local:  # A bucket run: a local copy.
    for name in tokenizers.HF_FILES:
      path = os.path.join(local, tokenizers.HF_DIR, name)
      if os.path.isfile(path):
        shutil.copyfile(path, os.path.join(out_dir, name))
    spm = os.path.join(local, tokenizers.SPM_FILE)
    if os.path.isfile(spm):
      _export_spm_tokenizer(spm, out_dir)


def _export_spm_tokenizer(spm_path: str, out_dir: str) -> None:
  """The run's SentencePiece model as `tokenizer.model` with a tokenizer_config.json for
  transformers' LlamaTokenizer, set to encode as the run did: no BOS / EOS added, no
  prefix space (the model was trained without a dummy prefix), pieces as they are
  (`legacy=False`), spaces kept on decode (tested against AutoTokenizer's ids)."""
  tok = tokenizers.SentencePieceTokenizer.load(spm_path)
  shutil.copyfile(spm_path, os.path.join(out_dir, "tokenizer.model"))
  piece = lambda i: tok.sp.id_to_piece(i) if i is not None and i >= 0 else None
  config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False,
            "add_eos_token": False, "add_prefix_space": False, "legacy": False,
            "clean_up_tokenization_spaces": False, "eos_token": piece(tok.eos_id),
            "unk_token": piece(int(tok.sp.unk_id())), "bos_token": None, "pad_token": None}
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
    json.dump(config, f, indent=2)

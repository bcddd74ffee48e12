"""The data path's speed: `python -m benchmarks.data_path [--quick] [--big] [--out FILE.json]`.

On synthetic JSONL (pseudo-words with a Zipf-like frequency, deterministic):

  prepare     `--mode prepare`'s input MB/s with the byte tokenizer and with a 32k BPE
              (the `tokenizers` library, trained here on a sample), beside that
              tokenizer's own batch-encode MB/s on the same texts (already parsed, in
              this process): the pipeline's overhead is 1 - prepare / encode
  memory      peak RSS of the whole prepare (its process and its workers, summed,
              polled from /proc) on a 0.5 GB corpus and, with --big, a 2 GB one: flat
              in corpus size means a ratio near 1
  input rate  batches/s of 8 x 2048 windows from the prepared (byte) dataset, locally
              (memmap) and through the object-store stand-in (fsspec's DirFileSystem
              registered as gs://: the remote code path of byte-range reads), beside
              config M's train step rate (benchmarks/common.py, batch 8 at its 512)

The prepare throughput is timed around `prepare()` in a fresh process (worker
start-up included); the memory cases run the user's `launch.py --mode prepare`.

Figures and their machine go in docs/PERFORMANCE.md ("Data path"). --quick shrinks
every corpus (a minute or two); the figures to quote are the default run's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from experiments.configs.base import data_defaults
from train.data.pipeline import make_source
from train.data.tokenizers import ByteTokenizer, HFTokenizer, encode_many

MB = 1 << 20
BATCH, SEQ = 8, 2048


def _words(n: int, rng) -> np.ndarray:
  syllables = np.array([c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"])
  lengths = rng.integers(1, 5, n)
  return np.array(["".join(rng.choice(syllables, k)) for k in lengths])


def write_jsonl(path: str, size: int, seed: int = 0) -> int:
  """~`size` bytes of JSONL documents ({"text": ...}); a 16 MB block of distinct
  documents is repeated (tokenizer speed depends on the text, not on its novelty)."""
  rng = np.random.default_rng(seed)
  vocab = _words(60_000, rng)
  lines, block = [], 0
  while block < min(size, 16 * MB):
    n = int(rng.integers(50, 800))
    ids = np.minimum(rng.zipf(1.2, n), len(vocab)) - 1
    text = " ".join(vocab[ids]) + ".\n"
    lines.append(json.dumps({"text": text}) + "\n")
    block += len(lines[-1])
  data = "".join(lines).encode()
  written = 0
  with open(path, "wb") as f:
    while written < size:
      f.write(data)
      written += len(data)
  return written


def texts_of(path: str, limit: int) -> list[str]:
  out, size = [], 0
  with open(path, "rb") as f:
    for line in f:
      out.append(json.loads(line)["text"])
      size += len(line)
      if size >= limit:
        break
  return out


def train_bpe(texts: list[str], vocab: int, path: str) -> None:
  import tokenizers  # pylint: disable=g-import-not-at-top
  from tokenizers import decoders, models, pre_tokenizers, trainers  # pylint: disable=g-import-not-at-top
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                special_tokens=["<|endoftext|>"], show_progress=False)
  tok.train_from_iterator(texts, trainer)
  tok.save(path)
  with open(os.path.join(os.path.dirname(path), "tokenizer_config.json"), "w") as f:
    json.dump({"eos_token": "<|endoftext|>"}, f)


def encode_rate(tokenizer: str, texts: list[str]) -> float:
  """The tokenizer's own bulk encode, MB of text per second."""
  tok = ByteTokenizer() if tokenizer == "byte" else HFTokenizer.load(tokenizer[3:])
  size = sum(len(t.encode()) for t in texts)
  t0 = time.perf_counter()
  for i in range(0, len(texts), 1024):
    encode_many(tok, texts[i:i + 1024])
  return size / MB / (time.perf_counter() - t0)


def _tree_rss(pid: int) -> int:
  """Resident bytes of a process and all its descendants (Linux /proc)."""
  total, todo = 0, [pid]
  while todo:
    p = todo.pop()
    try:
      with open(f"/proc/{p}/status") as f:
        total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))
      for task in os.listdir(f"/proc/{p}/task"):
        with open(f"/proc/{p}/task/{task}/children") as f:
          todo.extend(int(c) for c in f.read().split())
    except (OSError, StopIteration):
      continue
  return total


def _watch(cmd: list[str]) -> tuple[str, float, int]:
  """Runs `cmd` from the repository root: (stdout, seconds, peak RSS of its process tree)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  t0 = time.perf_counter()
  proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  peak = [0]

  def poll():
    while proc.poll() is None:
      peak[0] = max(peak[0], _tree_rss(proc.pid))
      time.sleep(0.1)

  watcher = threading.Thread(target=poll, daemon=True)
  watcher.start()
  stdout, stderr = proc.communicate()
  seconds = time.perf_counter() - t0
  watcher.join()
  if proc.returncode:
    raise RuntimeError(f"{cmd[:4]} failed: {stderr.decode()[-2000:]}")
  return stdout.decode(), seconds, peak[0]


def _vocab_flag(tokenizer: str) -> list[str]:
  if not tokenizer.startswith("hf:"):
    return []
  import tokenizers  # pylint: disable=g-import-not-at-top
  return [f"--config.data.vocab_size={tokenizers.Tokenizer.from_file(tokenizer[3:]).get_vocab_size()}"]


def prepare_memory(inputs: str, out: str) -> dict:
  """The user's command, `launch.py --mode prepare` (byte tokenizer), in a subprocess:
  peak RSS of its process tree (JAX's import in launch.py included)."""
  cmd = [sys.executable, "launch.py", "--mode", "prepare", "--input", inputs, "--output", out,
         "--config.data.val_fraction=0.01"]
  _, seconds, peak = _watch(cmd)
  size = os.path.getsize(inputs)
  return {"input_mb": size / MB, "seconds": seconds, "mb_per_s": size / MB / seconds,
          "peak_rss_mib": peak / MB}


def prepare_throughput(inputs: str, out: str, tokenizer: str) -> dict:
  """train.data.prepare.prepare in a fresh process, timed around the call alone (worker
  start-up included, the interpreter's and imports' not): input MB/s."""
  vocab = _vocab_flag(tokenizer)
  vocab_size = int(vocab[0].split("=")[1]) if vocab else 256
  code = ("import sys, time; from train.data.prepare import prepare; t = time.perf_counter(); "
          f"prepare([{inputs!r}], {out!r}, tokenizer={tokenizer!r}, vocab_size={vocab_size}, "
          "val_fraction=0.01, progress=False); print(time.perf_counter() - t)")
  stdout, _, peak = _watch([sys.executable, "-c", code])
  seconds = float(stdout.split()[-1])
  size = os.path.getsize(inputs)
  return {"input_mb": size / MB, "seconds": seconds, "mb_per_s": size / MB / seconds,
          "peak_rss_mib": peak / MB}


def input_rate(corpus: str, batches: int) -> float:
  """Train batches (8 x 2048) per second from a prepared dataset (first batch untimed)."""
  d = data_defaults()
  d.corpus = corpus
  source = make_source(d, None)
  for _ in range(2):  # The first pass brings the pages into the OS cache: time the second.
    it = source.train_iterator(0, BATCH, SEQ)
    next(it)
    t0 = time.perf_counter()
    for _ in range(batches):
      next(it)
  return batches / (time.perf_counter() - t0)


def remote_rate(prepared_dir: str, batches: int) -> float:
  """input_rate through gs:// served by fsspec's DirFileSystem over the same files."""
  import fsspec  # pylint: disable=g-import-not-at-top
  from fsspec.implementations.dirfs import DirFileSystem  # pylint: disable=g-import-not-at-top
  from fsspec.implementations.local import LocalFileSystem  # pylint: disable=g-import-not-at-top
  root = os.path.dirname(prepared_dir)

  class LocalBucket(DirFileSystem):
    protocol = ("gs",)

    def __init__(self, *args, **kw):
      super().__init__(path=root, fs=LocalFileSystem(), **kw)

  fsspec.register_implementation("gs", LocalBucket, clobber=True)
  return input_rate(f"gs://{os.path.basename(prepared_dir)}", batches)


def train_step_rate(steps: int) -> dict:
  """Config M's train step (benchmarks/common.py: float32, batch 8 at its length 512)."""
  # Here: benchmarks.common imports jax, which the data-path figures never need.
  from benchmarks import common  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  mode = common.MODES["quick"]
  cfg = common.model_config("M", mode)
  batch = common.random_batch(cfg)
  step = common.compile_train_step(cfg, batch)
  state = step.state
  state, m = step.fn(state, batch)
  jax.block_until_ready(m)
  t0 = time.perf_counter()
  for _ in range(steps):
    state, m = step.fn(state, batch)
  jax.block_until_ready(m)
  rate = steps / (time.perf_counter() - t0)
  return {"steps_per_s": rate, "tokens_per_s": rate * common.BATCH * cfg.max_seq_len,
          "seq_len": cfg.max_seq_len}


def run(quick: bool, big: bool, work: str) -> dict:
  sizes = {"throughput": 16 * MB if quick else 64 * MB,
           "memory": [64 * MB, 256 * MB] if quick else [512 * MB] + ([2048 * MB] if big else [])}
  out = {"load_before": os.getloadavg(), "cpus": os.cpu_count(), "quick": quick}
  src = os.path.join(work, "corpus.jsonl")
  write_jsonl(src, sizes["throughput"])
  texts = texts_of(src, 16 * MB)  # The repeated block: exactly the text prepared.
  bpe = os.path.join(work, "bpe", "tokenizer.json")
  os.makedirs(os.path.dirname(bpe))
  train_bpe(texts[:len(texts) // 2], 8192 if quick else 32768, bpe)
  out["prepare"] = {}
  for name, tok in (("byte", "byte"), ("bpe8k" if quick else "bpe32k", f"hf:{bpe}")):
    r = prepare_throughput(src, os.path.join(work, f"prep_{name}"), tok)
    r["encode_mb_per_s"] = encode_rate(tok, texts)
    r["overhead"] = 1 - r["mb_per_s"] / r["encode_mb_per_s"]
    out["prepare"][name] = r
    print(f"prepare {name}: {r['mb_per_s']:.1f} MB/s (tokenizer alone "
          f"{r['encode_mb_per_s']:.1f} MB/s: the pipeline reaches "
          f"{100 * (1 - r['overhead']):.0f}% of it)", flush=True)
  out["memory"] = []
  for size in sizes["memory"]:
    path = os.path.join(work, f"mem_{size // MB}.jsonl")
    write_jsonl(path, size, seed=1)
    r = prepare_memory(path, os.path.join(work, f"prep_mem_{size // MB}"))
    out["memory"].append(r)
    print(f"memory at {r['input_mb']:.0f} MB: peak RSS {r['peak_rss_mib']:.0f} MiB "
          f"({r['mb_per_s']:.1f} MB/s, launch.py start-up included)", flush=True)
    os.remove(path)
    shutil.rmtree(os.path.join(work, f"prep_mem_{size // MB}"))
  if len(out["memory"]) > 1:
    out["memory_ratio"] = out["memory"][-1]["peak_rss_mib"] / out["memory"][0]["peak_rss_mib"]
  n = 20 if quick else 100
  prepared_dir = os.path.join(work, "prep_byte")
  out["input"] = {"local_batches_per_s": input_rate(prepared_dir, n),
                  "object_store_batches_per_s": remote_rate(prepared_dir, n),
                  "batch": BATCH, "seq_len": SEQ}
  out["train_step_M"] = train_step_rate(2 if quick else 3)
  m = out["train_step_M"]
  for where in ("local", "object_store"):
    rate = out["input"][f"{where}_batches_per_s"]
    out["input"][f"{where}_vs_M_steps"] = rate / m["steps_per_s"]
    out["input"][f"{where}_vs_M_tokens"] = rate * BATCH * SEQ / m["tokens_per_s"]
    print(f"input {where}: {rate:.1f} batches/s of {BATCH}x{SEQ}: "
          f"{rate / m['steps_per_s']:.0f}x config M's {m['steps_per_s']:.3f} steps/s "
          f"({rate * BATCH * SEQ / m['tokens_per_s']:.0f}x its tokens/s)", flush=True)
  out["load_after"] = os.getloadavg()
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="Small corpora (a minute or two).")
  parser.add_argument("--big", action="store_true", help="Add the 2 GB memory case.")
  parser.add_argument("--out", default=None, help="Also write the JSON here.")
  parser.add_argument("--workdir", default=None, help="Scratch directory (default: a temp one).")
  args = parser.parse_args()
  work = args.workdir or tempfile.mkdtemp(prefix="data_path_")
  try:
    result = run(args.quick, args.big, work)
  finally:
    if args.workdir is None:
      shutil.rmtree(work, ignore_errors=True)
  print(json.dumps(result, indent=1))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()

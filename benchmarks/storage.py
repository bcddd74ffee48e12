"""Checkpoint save and restore time on an S3 server against a local directory.

  python -m benchmarks.storage --out storage.json                  # the 125m smoke state
  python -m benchmarks.storage --config 'pod.py:preset=125m' --out storage_125m.json

The TrainState of `--config` (default experiments/configs/pod.py:preset=125m,smoke),
float32 parameters and Adam moments on one CPU device, saved and restored through
train/checkpoint.py as the trainer does: `save` is orbax's save plus the checksums
(CHECKSUMS.json reads every object back), `seal` the checksums alone (written again
after the save), `restore` the verification plus orbax's restore, `verify` the
verification alone (on a bucket: one listing when no object was rewritten). Each
`--repeats` times into a fresh directory, the first included (figures: the median).

The S3 server is moto's (`moto_server`, in its own process on localhost, objects in its
memory), reached by AWS_ENDPOINT_URL: it measures the client's path (TensorStore's s3
driver, s3fs, the commit protocol, the request count), not a real bucket's bandwidth.
`storage_requests_per_repeat`: the requests train/io/storage.py sent per repeat (the
checksums' listings, heads and reads), `seal_requests` those of one `seal` by kind;
orbax's and TensorStore's own are not counted.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import flax.linen as nn
import jax

from experiments.configs import pod
from train import checkpoint as ckpt
from train.io import checksums, storage
from train.optim import make_optimizer
from train.state import init_state
from train.spec import model_config

DEFAULT_CONFIG = "pod.py:preset=125m,smoke"


def _state(config_arg: str):
  name, _, arg = config_arg.partition(":")
  if name != "pod.py":
    raise ValueError(f"--config {config_arg!r}: only pod.py presets are benchmarked")
  c = pod.get_config(arg)
  c.train.async_checkpoint = False
  state = jax.jit(lambda: nn.unbox(init_state(model_config(c), make_optimizer(c.train), 0,
                                                32)))()
  return c, jax.block_until_ready(state)


def _time(fn) -> float:
  t0 = time.perf_counter()
  fn()
  return time.perf_counter() - t0


def _orbax_save(workdir: str, c, state) -> float:
  """orbax's own save of `state` (as train/checkpoint.py's `save` asks for it), no checksums."""
  manager = ckpt.make_manager(workdir, c.train)
  args = ckpt.save_args(state, {})
  took = _time(lambda: (manager.save(1, args=args, force=True), manager.wait_until_finished()))
  manager.close()
  return took


def measure(root: str, c, state, repeats: int) -> dict:
  """Save / verify / restore times (s) of `state` under `root`, `repeats` times each."""
  shardings = jax.tree.map(lambda x: x.sharding, state)
  times = {"orbax_save_s": [], "save_s": [], "seal_s": [], "verify_s": [], "restore_s": []}
  before = storage.request_count()
  seal_requests = collections.Counter()
  for i in range(repeats):
    workdir = storage.join(root, f"run{i}")
    if i % 2 == 0:  # Alternately first: neither save always meets a fuller server.
      times["orbax_save_s"].append(_orbax_save(storage.join(root, f"orbax{i}"), c, state))
    manager = ckpt.make_manager(workdir, c.train)
    times["save_s"].append(_time(lambda: ckpt.save(manager, 1, state, {}, force=True)))
    manager.close()
    if i % 2 == 1:
      times["orbax_save_s"].append(_orbax_save(storage.join(root, f"orbax{i}"), c, state))
    sealed = storage.join(ckpt.checkpoint_dir(workdir), "1", checksums.CHECKSUMS_FILE)
    storage.delete(sealed)  # The checksums alone, again: their share of `save`.
    counts = collections.Counter(storage.REQUESTS)
    times["seal_s"].append(_time(lambda: checksums.seal(ckpt.checkpoint_dir(workdir), [1])))
    seal_requests.update(collections.Counter(storage.REQUESTS) - counts)
    reader = ckpt.make_manager(workdir, read_only=True)
    times["verify_s"].append(_time(lambda: checksums.verify(ckpt.checkpoint_dir(workdir), 1)))
    times["restore_s"].append(_time(lambda: jax.block_until_ready(
        ckpt.restore_step(reader, 1, state, shardings))))
    reader.close()
  out = {k: statistics.median(v) for k, v in times.items()}
  out.update({f"{k}_all": v for k, v in times.items()})
  step_dir = storage.join(ckpt.checkpoint_dir(storage.join(root, "run0")), "1")
  sizes = storage.files(step_dir)
  out.update(objects=len(sizes), bytes=sum(sizes.values()),
             save_over_orbax=out["save_s"] / out["orbax_save_s"],
             seal_requests={k: v / repeats for k, v in seal_requests.items()},
             storage_requests_per_repeat=(storage.request_count() - before) / repeats)
  return out


@contextlib.contextmanager
def s3_server():
  """moto's S3 server in its own process on a free port, with a bucket; yields its URL."""
  from tests.storage_servers import _wait_for, free_port  # pylint: disable=g-import-not-at-top
  port = free_port()
  server = os.path.join(os.path.dirname(sys.executable), "moto_server")
  proc = subprocess.Popen([server, "-p", str(port)], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  try:
    _wait_for(port)
    os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_EC2_METADATA_DISABLED="true")
    import s3fs  # pylint: disable=g-import-not-at-top
    s3fs.S3FileSystem().mkdir("blockwork-bench")
    yield "s3://blockwork-bench"
  finally:
    proc.terminate()
    proc.wait()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default=DEFAULT_CONFIG)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--out", default="")
  args = parser.parse_args()
  c, state = _state(args.config)
  n_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
  results = {}
  with tempfile.TemporaryDirectory() as local:
    results["local"] = measure(local, c, state, args.repeats)
  with s3_server() as bucket:
    results["s3"] = measure(bucket, c, state, args.repeats)
  for where, r in results.items():
    print(f"{where}: save {r['save_s']:.3f} s (seal {r['seal_s']:.3f} s, requests "
          f"{r['seal_requests']}), orbax's own save {r['orbax_save_s']:.3f} s (ratio "
          f"{r['save_over_orbax']:.2f}x), verify {r['verify_s']:.3f} s, restore "
          f"{r['restore_s']:.3f} s ({r['objects']} objects, {r['bytes']} bytes)", flush=True)
  out = {"config": args.config, "state_bytes": n_bytes, "repeats": args.repeats,
         "devices": jax.device_count(), "load_average": os.getloadavg(), "results": results}
  if args.out:
    with open(args.out, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()

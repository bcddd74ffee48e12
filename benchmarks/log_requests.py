"""Requests per training step of the run records on object storage:
`python -m benchmarks.log_requests [--steps N] [--checkpoint_every C] [--out FILE.json]`.

Trains the tiny smoke config with the real loop (train.loop.run) into a bucket of a
moto S3 server started on localhost (tests/storage_servers.py's way: AWS_ENDPOINT_URL,
fake credentials), logging every step, and counts what train/io/storage.py sent
(storage.REQUESTS, by operation). Checkpoint arrays go through TensorStore's own
client and are not in the count; the CHECKSUMS and commit objects that train/ writes
through train/io/storage.py are. Reported:

  requests            every storage-layer request of the run (lock, config, logs,
                      TensorBoard, checkpoint bookkeeping), by operation and in all
  logging_requests    the requests sent by train/metrics.py's MetricsWriter (metrics
                      segments, TensorBoard event files, reading config.json, the
                      resume check), and per step: the claim is that they are bounded
                      by the checkpoint cadence (one segment and one event file per
                      checkpoint, the end, and each 60 s), never one per step
  logging_objects     metrics segments + TensorBoard event files written
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from experiments.configs import tiny
from train.io import storage
from train.loop import run
from train.metrics import MetricsWriter


def _count_logging_requests(storage) -> list[int]:
  """[n]: the storage requests sent inside train/metrics.py's MetricsWriter (its writes,
  syncs, resume truncation, opening and closing), counted as the run goes."""
  total, depth = [0], [0]

  def counted(method):
    def wrapped(self, *args, **kwargs):
      before = storage.request_count()
      depth[0] += 1
      try:
        return method(self, *args, **kwargs)
      finally:
        depth[0] -= 1
        if not depth[0]:  # The outermost call (close and write call sync): counted once.
          total[0] += storage.request_count() - before
    return wrapped
  for name in ("__init__", "write", "sync", "truncate_after", "close"):
    setattr(MetricsWriter, name, counted(getattr(MetricsWriter, name)))
  return total


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.log_requests")
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--checkpoint_every", type=int, default=20)
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from tests import storage_servers  # pylint: disable=g-import-not-at-top
  with storage_servers.moto_s3():
    result = _measure(args)
  print(json.dumps(result, indent=1))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)
  return result


def _measure(args) -> dict:
  import s3fs  # pylint: disable=g-import-not-at-top
  s3fs.S3FileSystem().mkdir("log-requests")
  workdir = "s3://log-requests/run"
  c = tiny.get_config("smoke")
  c.train.update(steps=args.steps, log_every=1, eval_every=args.steps,
                 checkpoint_every=args.checkpoint_every)
  storage.REQUESTS.clear()
  logging_requests = _count_logging_requests(storage)
  t0 = time.time()
  run(c, workdir)
  seconds = time.time() - t0
  segments = len(storage.listdir(storage.join(workdir, "metrics.jsonl.parts")))
  events = len([p for p in storage.glob(storage.join(workdir, "tensorboard", "**"))
                if "tfevents" in p])
  requests = dict(storage.REQUESTS)
  return {"steps": args.steps, "checkpoint_every": args.checkpoint_every, "log_every": 1,
          "requests": requests, "requests_total": sum(requests.values()),
          "requests_per_step": sum(requests.values()) / args.steps,
          "metrics_segments": segments, "tensorboard_event_files": events,
          "logging_objects": segments + events,
          "logging_per_step": (segments + events) / args.steps,
          "logging_requests": logging_requests[0],
          "logging_requests_per_step": logging_requests[0] / args.steps,
          "run_seconds": seconds}


if __name__ == "__main__":
  main()

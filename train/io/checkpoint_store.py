"""Where orbax writes a run's checkpoints: a local directory, `gs://` or `s3://`.

orbax writes every array through TensorStore and everything else (its metadata, the
data-iterator JSON, the commit markers) through etils.epath (gcsfs / s3fs for a URL).

- A local directory: a step is written under a temporary name and renamed when whole.
- `gs://`: orbax's own path (TensorStore's `gcs` kvstore driver, ADC credentials).
- `s3://`: orbax 0.12.8 builds TensorStore specs for local paths and `gs://` only
  (`tensorstore_utils.build_kvstore_tspec` rejects an `s3://` directory as "not
  absolute"; it has no option that takes a kvstore spec: google/orbax#872, #2739).
  `enable_s3` teaches that one function TensorStore's `s3` driver: the spec orbax builds
  for the same path on GCS, its `gcs` kvstore swapped for an `s3` one (the same bucket
  and key prefix), so the arrays are written by TensorStore as on GCS, not copied from a
  local directory. TensorStore's s3 driver does not read AWS_ENDPOINT_URL (with only
  the variable it asks AWS itself), so an endpoint set there (an S3-compatible server:
  moto, MinIO) goes into the spec; credentials stay the AWS chain's, never in a spec
  that is written (with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY set, the spec names
  the environment provider, so TensorStore does not probe ~/.aws/ files and log errors). Pinned to the orbax versions it was checked against: another fails
  loudly here rather than writing elsewhere.

On a bucket a rename is a copy, so a step is written in place and finished by orbax's
commit protocol: `commit_success.txt`, written last into the step directory (and each
item's), marks it whole; orbax lists a step without it as unfinished, never restores
it, and a trainer's manager deletes it (orbax's default for `gs://`, chosen here for
every bucket). Any other URL protocol is refused by name: TensorStore cannot write it.
"""

from __future__ import annotations

import functools
import os

import orbax.checkpoint as ocp

from train.io import storage

PROTOCOLS = ("gs", "s3")  # The URLs TensorStore writes for orbax.
_CHECKED_ORBAX = ("0.12.",)  # Versions whose kvstore spec builder enable_s3 wraps.


def check(directory: str) -> None:
  """Refuses a checkpoint directory that orbax cannot write, naming why."""
  proto = storage.protocol(directory)
  if storage.is_url(directory) and proto not in PROTOCOLS:
    raise ValueError(
        f"checkpoints cannot be written to {directory}: orbax writes arrays through "
        f"TensorStore, which supports local paths, gs:// and s3://, not {proto}://")


def manager_options(directory: str) -> dict:
  """CheckpointManagerOptions fields for `directory`: the commit file on a bucket."""
  check(directory)
  if not storage.is_url(directory):
    return {}
  if storage.protocol(directory) == "s3":
    enable_s3()
  return {"atomicity_options": ocp.options.AtomicityOptions(
      mode=ocp.options.AtomicityMode.COMMIT_FILE)}


def s3_kvstore(bucket: str, path: str) -> dict:
  """TensorStore's `s3` kvstore for a key prefix, at AWS_ENDPOINT_URL_S3 /
  AWS_ENDPOINT_URL when one is set (botocore's variables), else AWS's own endpoint."""
  spec = {"driver": "s3", "bucket": bucket, "path": path}
  endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
  region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
  if endpoint:
    spec["endpoint"] = endpoint
    spec["aws_region"] = region or "us-east-1"  # A custom endpoint has no region lookup.
  elif region:
    spec["aws_region"] = region
  if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
    # Keys in the environment: TensorStore's default chain would still read ~/.aws/config
    # and ~/.aws/credentials first, logging "Failed to open file" and
    # "AuthCredentialsProvider ..." errors at every checkpoint where they do not exist.
    # The provider's type only, never the keys, goes into the spec.
    spec["aws_credentials"] = {"type": "environment"}
  return spec


def _to_s3(spec):
  """`spec` with each GCS kvstore replaced by the S3 kvstore of the same bucket and path."""
  if isinstance(spec, dict):
    if spec.get("driver") in ("gcs", "gcs_grpc"):
      return s3_kvstore(spec["bucket"], spec.get("path", ""))
    return {k: _to_s3(v) for k, v in spec.items()}
  if isinstance(spec, list):
    return [_to_s3(v) for v in spec]
  return spec


@functools.cache
def enable_s3() -> None:
  """Makes orbax's TensorStore specs for `s3://` directories use the `s3` driver (once
  per process)."""
  from orbax.checkpoint._src.serialization import tensorstore_utils  # pylint: disable=g-import-not-at-top
  version = getattr(ocp, "__version__", "?")
  build = getattr(tensorstore_utils, "build_kvstore_tspec", None)
  if build is None or not version.startswith(_CHECKED_ORBAX):
    raise RuntimeError(
        f"s3:// checkpoints: orbax-checkpoint {version} is not one this adapter was checked "
        f"against ({', '.join(v + '*' for v in _CHECKED_ORBAX)}); see train/io/checkpoint_store.py")

  @functools.wraps(build)
  def build_kvstore_tspec(directory, name=None, **kwargs):
    path = str(directory)
    for prefix in ("s3://", "s3:/"):  # os.path.normpath leaves "s3:/".
      if path.startswith(prefix):
        return _to_s3(build("gs://" + path[len(prefix):], name, **kwargs))
    return build(directory, name, **kwargs)

  tensorstore_utils.build_kvstore_tspec = build_kvstore_tspec

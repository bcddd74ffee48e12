"""Two real `jax.distributed` processes seal one local checkpoint step: each CRC-32s
the shard files it wrote, process 0 merges the parts into CHECKSUMS.json (a
collective, no read-back by one process), and a process that fails to checksum makes
both raise instead of leaving the other waiting (train/io/checksums.py)."""

import json
import zlib

import pytest

from tests.parallel import two_processes

_SCRIPT = """
import json, os, sys
import jax
from jax.experimental import multihost_utils
root, port, i = sys.argv[1], sys.argv[2], int(sys.argv[3])
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=i)
from train.io import checksums, store_checksums
for step in (3, 4):
  shard = os.path.join(root, str(step), "state", f"ocdbt.process_{i}", "d")
  os.makedirs(shard, exist_ok=True)
  with open(os.path.join(shard, "x"), "wb") as f:
    f.write(bytes([i + 1]) * (1000 + i))
  if i == 0:
    with open(os.path.join(root, str(step), "commit_success.txt"), "w") as f:
      f.write("done")
multihost_utils.sync_global_devices("written")
checksums.seal(root, checksums.unsealed(root, [3]))
if i == 1:  # Process 1 alone fails to checksum step 4.
  store_checksums.compute = lambda path, kind: (_ for _ in ()).throw(OSError("unreadable"))
try:
  checksums.seal(root, checksums.unsealed(root, [4]))
except OSError as e:
  print("RAISED", e, flush=True)
"""


@pytest.mark.multihost
def test_two_processes_seal_their_own_shards_and_fail_together(tmp_path):
  script = tmp_path / "seal.py"
  script.write_text(_SCRIPT)
  root = tmp_path / "checkpoints"
  logs = two_processes.run(lambda i, port: [str(script), str(root), str(port), str(i)],
                           tmp_path, devices_per_process=1, timeout_s=120)
  record = json.loads((root / "3" / "CHECKSUMS.json").read_text())
  assert record["format"] == 2
  assert {rel: e["crc32"] for rel, e in record["files"].items()} == {
      "commit_success.txt": zlib.crc32(b"done"),
      "state/ocdbt.process_0/d/x": zlib.crc32(b"\x01" * 1000),
      "state/ocdbt.process_1/d/x": zlib.crc32(b"\x02" * 1001)}
  for log in logs:
    assert "RAISED" in log.read_text() and "process 1: OSError: unreadable" in log.read_text()
  assert not (root / "4" / "CHECKSUMS.json").exists()

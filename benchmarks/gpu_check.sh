#!/usr/bin/env bash
# The GPU check of issue 29, for a host with an NVIDIA GPU: installs the CUDA extra,
# runs the attention-implementation equivalence tests on the GPU (cuDNN, blockwise and
# the xla reference against each other) and measures bfloat16 training MFU of the ~1B
# preset against the GPU's measured matmul peak. Everything lands in OUT (default
# gpu_check/): attention.xml (pytest's JUnit report), gpu_mfu.json, summary.json.
#
#   bash benchmarks/gpu_check.sh [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-gpu_check}"
mkdir -p "$OUT"
PY="${PYTHON:-.venv/bin/python}"
"$PY" -m pip install -q -e '.[cuda,test]'
"$PY" -c 'import jax; assert jax.default_backend() == "gpu", jax.devices(); print(jax.devices())'
# tests/conftest.py defaults JAX_PLATFORMS to cpu: say cuda, so the kernels run on the GPU.
set +e
JAX_PLATFORMS=cuda "$PY" -m pytest tests/model/test_attention_impl.py -q -n 0 \
    -p no:cacheprovider --junitxml="$OUT/attention.xml"
tests_rc=$?
set -e
JAX_PLATFORMS=cuda "$PY" -m benchmarks.gpu_mfu --out "$OUT/gpu_mfu.json"
"$PY" - "$OUT" "$tests_rc" <<'PYEOF'
import json, sys, xml.etree.ElementTree as ET
out, rc = sys.argv[1], int(sys.argv[2])
suite = ET.parse(f"{out}/attention.xml").getroot()
suite = suite if suite.tag == "testsuite" else suite[0]
counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
mfu = json.load(open(f"{out}/gpu_mfu.json"))
summary = {"attention_tests": counts, "attention_tests_rc": rc,
           "device": mfu["device"]["device_kind"], "mfu_vs_measured_peak": mfu["mfu_vs_measured_peak"],
           "tokens_per_s": mfu["tokens_per_s"], "matmul_peak_bf16": mfu["matmul_peak_bf16"]}
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
print(json.dumps(summary, indent=1))
PYEOF
exit "$tests_rc"

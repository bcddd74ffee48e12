"""blockwork benchmarks: `python -m benchmarks.run [--quick] --out FILE.json` (see run.py)."""

"""blockwork.experiments: configs, sweeps and reports."""

# A plain CPU script (`python -m benchmarks.decode`, a notebook's `from train import
# load_run`) must not probe for a TPU once libtpu is installed: JAX_PLATFORMS=cpu where
# no accelerator is attached and the user set none (train/hostenv.py). Before jax loads.
from train.hostenv import quiet_backend_default as _quiet  # pylint: disable=g-bad-import-order
_quiet()

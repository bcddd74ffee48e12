"""The backend a trace is for: `jax.default_backend()`, unless an ahead-of-time compile
for devices that are not attached (train/aot/: TPU on a CPU host) says otherwise.

Model code that picks a kernel by backend (attention "auto", the vendor kernels' own
check, MoE's grouped matmul) asks `backend()`, so a TPU compile on a CPU traces the
program the pod would run.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

_TARGET = contextvars.ContextVar("blockwork_target_backend", default=None)


def backend() -> str:
  return _TARGET.get() or jax.default_backend()


@contextlib.contextmanager
def target_backend(name: str):
  """Traces inside it run (and "auto" resolves) as on `name` ("tpu", "gpu")."""
  token = _TARGET.set(name)
  try:
    yield
  finally:
    _TARGET.reset(token)

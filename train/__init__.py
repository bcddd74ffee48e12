"""blockwork.train: the training system.

  spec/       the typed run spec: a config parsed once (sections, checks, derived fields)
  lifecycle/  session.open_run (the one opener of a run directory for every mode), lock,
              config record, resume policy, load_run
  data/       the data path: corpora, tokenizers, packing, sources (make_source)
  io/         a run directory's bytes: storage (local or bucket), staging, run logs,
              checksums, the checkpoint store
  eval/       in-loop evaluator, --mode eval, named corpora, harness and retrieval tasks
  aot/        --mode compile: compile for TPU topologies, fit search, report
  loop.py     run(config, workdir): the step loop; step.py, state.py, optim.py
  checkpoint.py, metrics.py, hostenv.py (launch.py's first step); tools: generate.py, convert.py

    from train import load_run
    run = load_run("runs/x")   # config, model_config, variables, tokenizer, metrics
"""

__all__ = ["Run", "load_run"]

# A plain CPU script (`python -m benchmarks.decode`, a notebook's `from train import
# load_run`) must not probe for a TPU once libtpu is installed: JAX_PLATFORMS=cpu where
# no accelerator is attached and the user set none (train/hostenv.py). Before jax loads.
from train.hostenv import quiet_backend_default as _quiet  # pylint: disable=g-bad-import-order
_quiet()


def __getattr__(name: str):
  """`Run` and `load_run` import jax on first use: `train.hostenv` must be importable
  (launch.py's first step) without starting anything heavy."""
  if name in __all__:
    # Lazy: train.hostenv (launch.py's first step) must import without jax.
    from train.lifecycle import load  # pylint: disable=g-import-not-at-top
    return getattr(load, name)
  raise AttributeError(f"module 'train' has no attribute {name!r}")

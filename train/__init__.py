"""blockwork.train: data, train loop, checkpoints, logs.

    from train import load_run
    run = load_run("runs/x")   # config, model_config, variables, tokenizer, metrics
"""

__all__ = ["Run", "load_run"]


def __getattr__(name: str):
  """`Run` and `load_run` import jax on first use: `train.hostenv` must be importable
  (launch.py's first step) without starting anything heavy."""
  if name in __all__:
    from train import run  # pylint: disable=g-import-not-at-top
    return getattr(run, name)
  raise AttributeError(f"module 'train' has no attribute {name!r}")

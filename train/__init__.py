"""blockwork.train: data, train loop, checkpoints, logs.

    from train import load_run
    run = load_run("runs/x")   # config, model_config, variables, tokenizer, metrics
"""

from train.run import Run, load_run

__all__ = ["Run", "load_run"]

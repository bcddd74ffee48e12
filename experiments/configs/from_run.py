"""The config of an existing run directory: `--config experiments/configs/from_run.py:RUN`.

Continues or fine-tunes a run (e.g. one made by `--mode import`) with its own
model section; command-line overrides apply on top:

  python launch.py --config experiments/configs/from_run.py:runs/llama \
      --workdir runs/llama --config.train.steps=1000
"""

from train.lifecycle import config_record


def get_config(arg: str | None = None):
  if not arg:
    raise ValueError("from_run.py needs the run directory: --config "
                     "experiments/configs/from_run.py:RUN")
  return config_record.read_config(arg)

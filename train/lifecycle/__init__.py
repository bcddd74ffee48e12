"""The run lifecycle: a run directory from its first step to its readers.

  session.py        what training and evaluating both build from a config: mesh,
                    this host's data source, the train state's layout
  lock.py           one trainer per run directory (RUN/LOCK)
  config_record.py  config.json (the resolved config and `_run`, the environment),
                    and what a directory already holds
  changes.py        config changes on resume: operational or deliberate, recorded
                    in config_changes.jsonl with their step
  resume.py         the resume policy: start fresh, resume, or refuse
  load.py           load_run(workdir): open a run for analysis (never changes it)
  goodput.py        where each training attempt's wall time went (RUN/goodput.jsonl)

The step loop that uses them is train/loop.py's `run`.
"""

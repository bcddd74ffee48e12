"""Evaluation tasks beyond the loss: lm-evaluation-harness tasks (harness.py, through
the `eval` extra), long-context retrieval (retrieval.py) and their registry (tasks.py),
all scored by scoring.py. docs/evaluation.md is the user's page."""

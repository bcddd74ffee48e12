"""Evaluation, all of it: the in-loop `Evaluator` (evaluator.py), `launch.py --mode eval`
(mode.py), named extra corpora (corpora.py), and the tasks beyond the loss:
lm-evaluation-harness tasks (harness.py, through the `eval` extra), long-context
retrieval (retrieval.py) and their registry (tasks.py), all scored by scoring.py.
docs/evaluation.md is the user's page."""

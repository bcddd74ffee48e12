"""docs/evaluation.md's local-task YAML, as a user copies it, loads in the harness without
a warning (it names each metric's aggregation and direction)."""

import json
import logging
import os
import re

import pytest

from tests.cli import ROOT


def test_the_documented_local_task_loads_without_a_harness_warning(tmp_path, caplog):
  pytest.importorskip("lm_eval")
  from train.eval.tasks import check_tasks, load_harness_tasks  # pylint: disable=g-import-not-at-top
  doc = open(os.path.join(ROOT, "docs", "evaluation.md")).read()
  yaml = re.search(r"```yaml\n(task: my_mc\n.*?)```", doc, re.S).group(1)
  data = tmp_path / "my_mc.jsonl"
  data.write_text(json.dumps({"question": "1 + 1 =", "choices": [" 2", " 3"], "label": 0}) + "\n")
  (tmp_path / "my_mc.yaml").write_text(yaml.replace("/data/my_mc.jsonl", str(data)))
  with caplog.at_level(logging.WARNING):  # As eval.tasks=my_mc, eval.task_dir=DIR loads it.
    harness, _, manager = check_tasks(["my_mc"], str(tmp_path))
    tasks = load_harness_tasks(harness, manager)
  assert "my_mc" in tasks
  warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
  assert not [w for w in warned if "my_mc" in w], warned

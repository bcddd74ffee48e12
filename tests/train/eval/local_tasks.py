"""Two local lm-evaluation-harness tasks the tests write (a YAML + JSONL each, offline):
"bw_mc" (multiple choice: which sum is right) and "bw_gen" (generate_until)."""

from __future__ import annotations

import json
import os

import numpy as np

MC_DOCS = 16


def write_tasks(directory: str) -> str:
  """Writes bw_mc and bw_gen into `directory` (the eval.task_dir); returns it."""
  os.makedirs(directory, exist_ok=True)
  rng = np.random.default_rng(0)
  with open(os.path.join(directory, "mc.jsonl"), "w") as f:
    for _ in range(MC_DOCS):
      a, b = (int(x) for x in rng.integers(1, 9, 2))
      choices = [f" {a + b}", f" {a + b + 1}", f" {a * b + 3}"]
      label = int(rng.integers(3))
      choices[0], choices[label] = choices[label], choices[0]
      f.write(json.dumps({"question": f"ROMEO: {a} and {b} make", "choices": choices,
                          "label": label}) + "\n")
  with open(os.path.join(directory, "gen.jsonl"), "w") as f:
    for i in range(4):
      f.write(json.dumps({"prompt": f"JULIET: say {i}:", "answer": f" {i}"}) + "\n")
  _yaml(directory, "bw_mc", "mc.jsonl", "multiple_choice", [
      'doc_to_text: "{{question}}"', 'doc_to_choice: "{{choices}}"',
      'doc_to_target: "{{label}}"', "metric_list:", "  - metric: acc",
      "    aggregation: mean", "    higher_is_better: true"])
  _yaml(directory, "bw_gen", "gen.jsonl", "generate_until", [
      'doc_to_text: "{{prompt}}"', 'doc_to_target: "{{answer}}"', "generation_kwargs:",
      '  until: ["\\n"]', "  max_gen_toks: 4", "  do_sample: false", "metric_list:",
      "  - metric: exact_match", "    aggregation: mean", "    higher_is_better: true"])
  return directory


def _yaml(directory: str, task: str, data: str, output_type: str, lines: list[str]) -> None:
  head = [f"task: {task}", "dataset_path: json", "dataset_kwargs:", "  data_files:",
          f"    test: {os.path.join(directory, data)}", "test_split: test",
          f"output_type: {output_type}"]
  with open(os.path.join(directory, f"{task}.yaml"), "w") as f:
    f.write("\n".join(head + lines) + "\n")

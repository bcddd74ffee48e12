"""The evaluation task registry: `eval.tasks` names harness tasks and retrieval tasks.

    figures = run_tasks(model_cfg, variables, tokenizer, config.eval, seq_len)
    # {"hellaswag/acc": 0.31, "hellaswag/acc_stderr": 0.01, "hellaswag/n": 10042,
    #  "passkey/exact@256": 0.75, "passkey/exact@256/depth50": 1.0, ...}

Retrieval tasks (train/eval/retrieval.py): "passkey", "multi_needle". Every other
name is an lm-evaluation-harness task (or group): the harness's own registry (its
datasets come from the Hugging Face Hub, so they need the network or a filled
cache) plus the YAML task files under `eval.task_dir` (local task definitions
with local JSONL data work offline). An unknown name is refused before anything
is evaluated, listing the local and retrieval tasks and the closest harness names.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
from typing import Any, Sequence

from model import ModelConfig
from train.eval import retrieval as rt
from train.spec.sections import EVAL_TASK_FIELDS, defaults

log = logging.getLogger(__name__)
RETRIEVAL_TASKS = ("passkey", "multi_needle")

# config.eval's task fields and their defaults (experiments/configs/base.py takes them;
# a run recorded before they existed is evaluated with them).
# The task fields of config.eval (train/spec/sections.py EvalSpec) at their defaults.
DEFAULTS = {k: v for k, v in defaults("eval").items() if k in EVAL_TASK_FIELDS}


def parse_tasks(spec: Any) -> list[str]:
  """eval.tasks as names: "a,b", ("a", "b") or "" (none)."""
  items = spec.split(",") if isinstance(spec, str) else list(spec or ())
  names = [str(n).strip() for n in items if str(n).strip()]
  for name in names:
    if names.count(name) > 1:
      raise ValueError(f"eval.tasks: {name!r} is listed twice")
  return names


def _task_manager(harness: Sequence[str], task_dir: str):
  """A TaskManager over eval.task_dir alone when it defines every name (indexing the
  harness's ~15k built-in tasks costs seconds), else over both."""
  from lm_eval.tasks import TaskManager  # pylint: disable=g-import-not-at-top
  if task_dir and not os.path.isdir(task_dir):
    raise ValueError(f"eval.task_dir={task_dir!r}: no such directory")
  if task_dir:
    local = TaskManager(include_path=task_dir, include_defaults=False)
    if set(harness) <= set(local.all_tasks):
      return local, list(local.all_tasks)
  full = TaskManager(include_path=task_dir or None)
  return full, (list(local.all_tasks) if task_dir else [])


def check_tasks(names: Sequence[str], task_dir: str = ""):
  """(harness names, retrieval names, TaskManager or None); unknown names raise."""
  retrieval = [n for n in names if n in RETRIEVAL_TASKS]
  harness = [n for n in names if n not in RETRIEVAL_TASKS]
  if not harness:
    return harness, retrieval, None
  try:
    manager, local = _task_manager(harness, task_dir)
  except ImportError:
    raise ValueError(f"eval.tasks={','.join(harness)}: lm-evaluation-harness tasks need "
                     "the `eval` extra: pip install -e '.[eval]'") from None
  known = set(manager.all_tasks)
  for name in harness:
    if name not in known:
      close = difflib.get_close_matches(name, sorted(known), n=5)
      raise ValueError(
          f"eval.tasks: unknown task {name!r}. Known: retrieval tasks "
          f"{', '.join(RETRIEVAL_TASKS)}; local tasks (eval.task_dir={task_dir!r}): "
          f"{', '.join(sorted(local)) or 'none'}; {len(known) - len(local)} harness tasks"
          + (f", the closest: {', '.join(close)}" if close else ""))
  return harness, retrieval, manager


def load_harness_tasks(harness: Sequence[str], manager) -> dict[str, dict]:
  """name -> the harness's loaded task dict ({"tasks", "groups", "group_map"}); a dataset
  that cannot be read is reported naming its task."""
  out = {}
  for name in harness:
    try:
      out[name] = manager.load([name])
    except Exception as e:  # pylint: disable=broad-except  # datasets raises many kinds.
      raise ValueError(
          f"eval.tasks: task {name!r}: its dataset cannot be loaded ({type(e).__name__}: "
          f"{str(e)[:300]}); harness datasets come from the Hugging Face Hub: check the "
          "network (or HF_DATASETS_OFFLINE with a filled cache), or define the task "
          "locally (a YAML with local JSONL data in eval.task_dir)") from None
  return out


def run_harness(lm, tasks: dict[str, dict], num_fewshot: int | None, limit: int | None,
                seed: int = 0) -> dict[str, float]:
  """Runs the loaded tasks on `lm`; flat figures "<task>/<metric>" (+ _stderr, /n), and
  "<task>/untokenizable": the fraction of texts the tokenizer does not round-trip.

  The harness's `evaluate` with simple_evaluate's task set-up (few-shot count and
  seed), without its environment report (pip and torch probes, seconds per call).
  """
  from lm_eval.evaluator import evaluate  # pylint: disable=g-import-not-at-top
  figures: dict[str, float] = {}
  for name, loaded in tasks.items():
    for task in loaded["tasks"].values():
      default = task.get_config("num_fewshot")
      if num_fewshot is not None and default != 0:  # A task's own 0 is never overridden.
        task.set_config(key="num_fewshot", value=num_fewshot)
      elif default is None:
        task.set_config(key="num_fewshot", value=0)
      task.set_fewshot_seed(seed=seed)
    counting = hasattr(lm, "untokenizable")  # BlockworkLM; the harness's own models not.
    if counting:
      lm.untokenizable.clear()
      lm.requests = 0
    result = evaluate(lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=100,
                      log_samples=False, verbosity="WARNING")
    figures.update(flatten_results(result))
    if counting and lm.untokenizable:
      bad = sum(lm.untokenizable.values())
      figures[f"{name}/untokenizable"] = bad / max(lm.requests, 1)
      log.warning("task %s: %d of %d texts do not decode back to themselves under the "
                  "run's tokenizer (e.g. %r): their scores are of other text", name, bad,
                  lm.requests, next(iter(lm.untokenizable)))
  return figures


def flatten_results(result: dict) -> dict[str, float]:
  """simple_evaluate's {"results": {task: {"acc,none": x, ...}}} -> {"task/acc": x}."""
  out = {}
  for task, metrics in result["results"].items():
    for key, value in metrics.items():
      metric, _, filt = key.partition(",")
      if (not isinstance(value, (int, float)) or isinstance(value, bool)
          or metric in ("alias", "sample_len")):
        continue
      name = metric if filt in ("", "none") else f"{metric}_{filt}"
      value = float(value)
      if not math.isfinite(value) and name.endswith("_stderr"):
        continue  # "N/A" stderr (bootstrap off) is not a figure.
      out[f"{task}/{name}"] = value
  for task, n in result.get("n-samples", {}).items():
    out[f"{task}/n"] = float(n.get("effective", n.get("original", 0)))
  return out


def run_tasks(model_cfg: ModelConfig, variables: Any, tokenizer, eval_cfg, seq_len: int,
              checked=None) -> dict[str, float]:
  """Every task of eval.tasks on one model; `checked`: check_tasks' result, if known."""
  names = parse_tasks(eval_cfg.tasks)
  if not names:
    return {}
  harness, retrieval, manager = checked or check_tasks(names, eval_cfg.task_dir)
  figures: dict[str, float] = {}
  if harness:
    # Optional dependency: harness.py imports lm_eval (the `eval` extra).
    from train.eval.harness import BlockworkLM  # pylint: disable=g-import-not-at-top
    lm = BlockworkLM(model_cfg, variables, tokenizer,
                     batch_size=int(eval_cfg.task_batch_size))
    fewshot = eval_cfg.num_fewshot
    limit = int(eval_cfg.task_limit) or None
    figures.update(run_harness(lm, load_harness_tasks(harness, manager),
                               None if fewshot is None or fewshot < 0 else int(fewshot),
                               limit))
  if retrieval:
    for name in retrieval:
      figures.update(rt.run_retrieval(name, model_cfg, variables, tokenizer, eval_cfg,
                                      seq_len))
  return figures

"""The layout's promises (issue 44), read from the source: a typed spec read once, one
ModelConfig construction, no re-defaulted config fields, homes by component, and no
cycles hidden behind function-local imports."""

import ast
import pathlib

from tests.cli import ROOT

PROJECT = ("model", "parallel", "train", "experiments", "interop", "benchmarks")
CONFIG_SECTIONS = {"train", "data", "eval", "model", "mesh", "hardware"}
CONFIG_NAMES = {"config", "cfg", "data_cfg", "train_cfg", "eval_cfg", "mesh_cfg"}


def _modules(*roots: str):
  for root in roots:
    for path in sorted(pathlib.Path(ROOT, root).rglob("*.py")):
      yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text()), path.read_text()


def _functions(tree):
  return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_train_has_at_most_18_flat_modules():
  flat = sorted(p.name for p in pathlib.Path(ROOT, "train").glob("*.py"))
  assert len(flat) <= 18, flat


def test_function_local_project_imports_are_few_and_each_says_why():
  found = []
  for path, tree, text in _modules(*PROJECT):
    lines = text.splitlines()
    for fn in _functions(tree):
      for node in ast.walk(fn):
        names = ([node.module] if isinstance(node, ast.ImportFrom) and node.level == 0
                 else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        if any((n or "").split(".")[0] in PROJECT for n in names):
          above = " ".join(lines[max(0, node.lineno - 4):node.lineno - 1])
          found.append((path, node.lineno, "#" in above or "Imported here" in above))
  found = sorted(set(found))
  assert len(found) < 20, found
  assert all(has_reason for *_, has_reason in found), [f for f in found if not f[2]]


def test_a_model_config_is_built_from_a_config_in_one_place():
  builders = []
  for path, tree, _ in _modules("train"):
    for node in ast.walk(tree):
      if isinstance(node, ast.Call):
        f = node.func
        name = (f.attr if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                and f.value.id == "ModelConfig" else f.id if isinstance(f, ast.Name) else "")
        if name in ("from_dict", "ModelConfig"):
          builders.append(path)
  assert builders == ["train/spec/parse.py"], builders


def test_no_config_field_is_re_defaulted_outside_the_spec():
  """`config.train.get("x", default)` / `data_cfg.get(...)`: the schema's defaults live in
  train/spec/sections.py, and the parser fills every field."""
  regets = []
  for path, tree, _ in _modules("train"):
    if path.startswith("train/spec/"):
      continue
    for node in ast.walk(tree):
      if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
          and node.func.attr == "get":
        owner = node.func.value
        if (isinstance(owner, ast.Name) and owner.id in CONFIG_NAMES) or (
            isinstance(owner, ast.Attribute) and owner.attr in CONFIG_SECTIONS):
          regets.append(f"{path}:{node.lineno}")
  assert not regets


def test_the_checks_run_only_from_the_parser_and_fingerprints_compare_in_one_function():
  check_calls, compares = [], []
  for path, tree, _ in _modules("train", "experiments", "interop", "benchmarks"):
    for fn in _functions(tree):
      for node in ast.walk(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and node.func.attr in ("check_sections", "check_against_model"):
          check_calls.append(f"{path}:{fn.name}")
        if isinstance(node, ast.Compare) and any(
            isinstance(x, ast.Call) and getattr(x.func, "id", "") == "fingerprint"
            or isinstance(x, ast.Name) and x.id in ("got", "want", "expect")
            for x in (node.left, *node.comparators)) and "fingerprint" in ast.unparse(fn):
          compares.append(f"{path}:{fn.name}")
  assert sorted(set(check_calls)) == ["train/spec/parse.py:parse"], check_calls
  assert sorted(set(compares)) == ["train/data/tokenizers.py:require_tokenizer"], compares

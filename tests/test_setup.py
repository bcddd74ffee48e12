"""Packaging: accelerator builds install through extras; every import is declared."""

import ast
import configparser
import glob
import importlib.metadata
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("model", "parallel", "train", "experiments", "benchmarks", "interop")


def _setup():
  cfg = configparser.ConfigParser()
  cfg.read(os.path.join(ROOT, "setup.cfg"))
  split = lambda text: [line.strip() for line in text.splitlines() if line.strip()]
  extras = {k: split(v) for k, v in cfg["options.extras_require"].items()}
  return split(cfg["options"]["install_requires"]), extras


def _name(requirement: str) -> str:
  return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_backends_are_extras_and_make_installs_cpu():
  requires, extras = _setup()
  assert not any("[" in r for r in requires if _name(r) == "jax"), "jax[cpu] in install_requires"
  assert {"jax", "jaxlib"} <= {_name(r) for r in requires}
  for extra, backend in [("cpu", "jax[cpu]"), ("cuda", "jax[cuda12]"), ("tpu", "jax[tpu]")]:
    assert any(r.startswith(backend) for r in extras[extra]), extra
  makefile = open(os.path.join(ROOT, "Makefile")).read()
  default = re.search(r"^EXTRAS \?= (.*)$", makefile, re.M).group(1).split(",")
  assert "cpu" in default and "test" in default  # `make test` on a fresh machine.
  assert "-e '.[$(EXTRAS)]'" in makefile
  readme = open(os.path.join(ROOT, "README.md")).read()  # Issue 46 item 8: says the same.
  said = re.search(r"`make` installs into `.venv` with `pip install -e '\.\[([\w,-]+)\]'`",
                   readme)
  assert said and said.group(1).split(",") == default, (said and said.group(1), default)


def _imports(path):
  for node in ast.walk(ast.parse(open(path).read())):
    if isinstance(node, ast.Import):
      yield from (a.name.split(".")[0] for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      yield node.module.split(".")[0]


def test_every_third_party_import_is_declared():
  """A module imported directly (ml_dtypes, pandas, ...) must be a declared dependency,
  not something that happens to come with another one."""
  requires, extras = _setup()
  declared = {_name(r) for r in requires + sum(extras.values(), [])}
  dists = importlib.metadata.packages_distributions()
  files = [os.path.join(ROOT, "launch.py")] + [
      f for p in PACKAGES for f in glob.glob(os.path.join(ROOT, p, "**", "*.py"), recursive=True)]
  ours = set(PACKAGES) | {"launch", "tests"} | set(sys.stdlib_module_names)
  missing = {}
  for f in files:
    for module in set(_imports(f)) - ours:
      names = {_name(d) for d in dists.get(module, [module])}
      if not names & declared:
        missing.setdefault(module, os.path.relpath(f, ROOT))
  assert not missing, f"imported but not declared in setup.cfg: {missing}"

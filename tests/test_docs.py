"""The documentation's cross-references resolve (no jax; about a second).

README.md and docs/*.md:
- a relative link `[text](path)` or `[text](path#anchor)` names an existing file and,
  with an anchor, one of its headings (GitHub's slugs; `#anchor` alone: this page);
- a repository path in the text (`model/flops.py`, `experiments/configs/tiny.py:smoke`,
  `tests/parallel/`) exists; a bare `name.py` is some file of the repository;
- `python -m pkg.mod`, `from pkg.mod import a, b` and a backticked `pkg.mod.name` name a
  module that exists and that defines the name.
Python sources and the pages: a section reference (`docs/PERFORMANCE.md, "Method"`,
`README, "Tests"`) names an existing heading of that page, or the part of one before its
":" or "("; in Python a mention of README names the section, and a repository path
(`train/loop.py`, `tests/parallel/`) exists.
Each test reports every broken reference at once, as file:line.
"""

from __future__ import annotations

import functools
import os
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOT_SOURCE = {".venv", "runs", "__pycache__", "build", "dist", ".git", ".pytest_cache"}
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"`([^`]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
PATH = re.compile(r"(?<![\w./@:-])((?:[\w.-]+/)+[\w.-]*)")
BARE_PY = re.compile(r"(?<![\w./-])([\w-]+\.py)\b")
MODULE_RUN = re.compile(r"python\S*\s+-m\s+([\w.]+)")
FROM_IMPORT = re.compile(r"^\s*from\s+([\w.]+)\s+import\s+([\w\s,]+?)\s*(?:#.*)?$")
DOTTED = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(.*\))?$")
# `README, "Heading"`, `docs/X.md "Heading"`; the heading may wrap onto a comment's next line.
SECTION_REF = re.compile(r"(README(?:\.md)?|docs/[\w.-]+\.md)(?:'s)?(?:,|\s)[ \t]*"
                         r"(\n[ \t]*#?)?[ \t]*\"([^\"\n]+(?:\n[ \t]*#?[ \t]*[^\"\n]+)?)\"")


def _source_files(suffix):
  for dirpath, dirnames, filenames in os.walk(ROOT):
    dirnames[:] = [d for d in dirnames
                   if d not in NOT_SOURCE and not d.startswith(".") and not d.endswith(".egg-info")]
    yield from (pathlib.Path(dirpath, f) for f in filenames if f.endswith(suffix))


@functools.cache
def _top_level():
  """The repository's own top-level entries: a path starting elsewhere (runs/x, RUN/...)
  is an example, not a file of the repository."""
  return {p.name for p in ROOT.iterdir()
          if p.name not in NOT_SOURCE and not p.name.startswith(".")
          and not p.name.endswith(".egg-info")}


@functools.cache
def _py_names():
  return {p.name for p in _source_files(".py")}


def _where(path, lineno):
  return f"{path.relative_to(ROOT)}:{lineno}"


def _lines(page):
  """(line number, text, in a fenced code block: the fences too) for each line of a page."""
  fenced = False
  for i, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
    fence = bool(FENCE.match(line))
    fenced ^= fence
    yield i, line, fenced or fence


def slug(heading: str) -> str:
  """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed,
  spaces to hyphens (letters, digits, `_` and `-` stay)."""
  text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
  return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@functools.cache
def headings(page: pathlib.Path) -> tuple[tuple[str, str], ...]:
  """(heading text, anchor) of a page, anchors numbered like GitHub's (x, x-1, x-2)."""
  seen, out = {}, []
  for _, line, fenced in _lines(page):
    m = None if fenced else HEADING.match(line)
    if m:
      base = slug(m.group(2))
      n = seen.get(base, 0)
      seen[base] = n + 1
      out.append((m.group(2), base if n == 0 else f"{base}-{n}"))
  return tuple(out)


def _link_problem(page, target):
  if re.match(r"^[a-z][\w+.-]*:", target):  # https:, mailto:, ...
    return None
  path, _, anchor = target.partition("#")
  file = (page.parent / path).resolve() if path else page
  if not file.exists():
    return f"link to {target}: no file {path}"
  if anchor and file.suffix == ".md" and anchor not in {a for _, a in headings(file)}:
    return f"link to {target}: no heading with anchor #{anchor} in {file.relative_to(ROOT)}"
  return None


def _path_problem(token):
  path = token.rstrip(".,;")
  if path.split("/")[0] not in _top_level() or (ROOT / path).exists():
    return None
  return f"no file or directory {path}"


def _module_file(dotted):
  base = ROOT.joinpath(*dotted.split("."))
  for f in (base.with_suffix(".py"), base / "__init__.py"):
    if f.is_file():
      return f
  return None


def _defines(module, name):
  text = _module_file(module).read_text(encoding="utf-8")
  return bool(re.search(rf"\b{re.escape(name)}\b", text)) or _module_file(f"{module}.{name}")


def _import_problems(module, names):
  if module.split(".")[0] not in _top_level():
    return []
  if _module_file(module) is None:
    return [f"no module {module}"]
  return [f"{module} does not define {n}" for n in names if not _defines(module, n)]


def _dotted_problems(span):
  """`model.attention.blockwise.auto_block`: a module path with at least two parts, then a name.
  (`model.num_kv_heads` is a config field: a package and one name is not checked.)"""
  m = DOTTED.match(span.strip())
  parts = m.group(1).split(".") if m else []
  for cut in range(len(parts), 1, -1):
    if _module_file(".".join(parts[:cut])):
      return _import_problems(".".join(parts[:cut]), parts[cut:cut + 1])
  return []


def _code_problems(line, fenced):
  spans = [line] if fenced else CODE_SPAN.findall(line)
  out = []
  for span in spans:
    out += [p for t in PATH.findall(span) if (p := _path_problem(t))]
    out += [f"no file named {t} in the repository"
            for t in BARE_PY.findall(span) if t not in _py_names()]
    out += [p for t in MODULE_RUN.findall(span) for p in _import_problems(t, [])]
    if m := FROM_IMPORT.match(span):
      out += _import_problems(m.group(1), [n.strip() for n in m.group(2).split(",") if n.strip()])
    if not fenced:
      out += _dotted_problems(span)
  return out


def _named_paths(text):
  """Path problems of a line of prose: a path needs an extension or a trailing "/" there
  ("train/eval steps" is prose)."""
  return [p for t in PATH.findall(text)
          if re.search(r"(\.\w+|/)$", t.rstrip(".,;")) and (p := _path_problem(t))]


def _link_problems(page):
  """(line, problem) of every link outside code; link text may wrap onto the next line."""
  prose = "\n".join("" if fenced else CODE_SPAN.sub(" ", line) for _, line, fenced in _lines(page))
  out = []
  for m in LINK.finditer(prose):
    if p := _link_problem(page, m.group(1)):
      out.append((prose.count("\n", 0, m.start()) + 1, p))
  return out


def _section_problems(file, text, in_python):
  """Every section reference (README, "Heading") in text; Python: every README mention
  and every repository path (`train/loop.py`, `tests/parallel/`) too."""
  out, named = [], set()
  for m in SECTION_REF.finditer(text):
    lineno = text.count("\n", 0, m.start()) + 1
    named.add(m.start())
    page = ROOT / ("README.md" if m.group(1).startswith("README") else m.group(1))
    title = re.sub(r"\s*\n[ \t]*#?[ \t]*", " ", m.group(3)).strip()
    if not page.exists():
      out.append(f"{_where(file, lineno)}: no page {m.group(1)}")
      continue
    anchors = {slug(s) for h, _ in headings(page) for s in (h, re.split(r":|\s\(", h)[0])}
    if slug(title) not in anchors:
      out.append(f"{_where(file, lineno)}: no heading \"{title}\" in {page.relative_to(ROOT)}")
  if not in_python:
    return out
  for lineno, line in enumerate(text.splitlines(), 1):
    out += [f"{_where(file, lineno)}: {p}" for p in _named_paths(line)]
  for m in re.finditer(r"README(?!\.md[\"'])", text):  # "README.md" in code is a path.
    if m.start() not in named:
      out.append(f"{_where(file, text.count(chr(10), 0, m.start()) + 1)}: names README "
                 f"without a section (write README, \"Heading\", or point to the docs/ page)")
  return out


def _report(broken):
  """All problems, in file and line order."""
  key = lambda s: (s.split(":")[0], int(s.split(":")[1]))
  return "\n".join(sorted(broken, key=key))


def test_markdown_links_paths_and_modules_resolve():
  broken = []
  for page in PAGES:
    for lineno, line, fenced in _lines(page):
      problems = _code_problems(line, fenced) + ([] if fenced else
                                                 _named_paths(CODE_SPAN.sub(" ", line)))
      broken += [f"{_where(page, lineno)}: {p}" for p in problems]
    broken += [f"{_where(page, lineno)}: {p}" for lineno, p in _link_problems(page)]
  assert not broken, "broken references in the documentation:\n" + _report(broken)


def test_section_references_and_python_paths_resolve():
  broken = []
  for page in PAGES:
    broken += _section_problems(page, page.read_text(encoding="utf-8"), in_python=False)
  for source in sorted(_source_files(".py")):
    if source != pathlib.Path(__file__).resolve():
      broken += _section_problems(source, source.read_text(encoding="utf-8"), in_python=True)
  assert not broken, "references that do not resolve:\n" + _report(broken)


def test_slugs_follow_github():
  assert slug("Resuming and failures") == "resuming-and-failures"
  assert slug("Third round: blockwise attention (after the second full run)") == (
      "third-round-blockwise-attention-after-the-second-full-run")
  assert slug("`model.ModelConfig` options") == "modelmodelconfig-options"
  assert slug("MoE *dispatch*, v2.1") == "moe-dispatch-v21"

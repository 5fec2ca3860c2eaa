"""Every repository path, module and test a README names exists, so the map cannot drift.

READMEs write repository paths from the repository root (`trainer/lit_module.py`), optionally
with `::name` parts (a test, a class, a function, `Class.attribute`) or a `[param]` id; module
names are written `sparkforge.<package>.<module>[.<name>]`. Markdown links are relative to the
README that holds them and may end in a `#heading` anchor.
"""

from __future__ import annotations

import ast
import re
import tomllib
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The tracked top-level folders and files a README may name; anything else (runs/, out/, s3://,
# vllm/...) is an example path or another project's file.
TOP_DIRS = ("producer", "trainer", "shared", "manifests", "docker", "benchmarks", "tests", ".ci")
TOP_FILES = ("Makefile", "pyproject.toml", "README.md")
# sparkforge.<name> -> its folder, as pyproject's package-dir maps it (sparkforge.app: shared/app).
PACKAGE_DIRS = {dotted.split(".", 1)[1]: folder for dotted, folder in tomllib.loads(
    (ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].items()}
READMES = sorted([ROOT / "README.md",
                  *(p for top in TOP_DIRS for p in (ROOT / top).rglob("README.md"))])

_SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_SPLIT = re.compile(r"[\s=,'\"()]+")
_MODULE = re.compile(r"^sparkforge(\.[A-Za-z_]\w*)+$")


def _tokens(text: str) -> list[str]:
    """Whitespace-separated words of inline code spans and fenced blocks."""
    spans = _SPAN.findall(_FENCE.sub("", text)) + _FENCE.findall(text)
    return [word.rstrip(".:;") for span in spans for word in _SPLIT.split(span) if word]


def _is_repo_path(token: str) -> bool:
    return token in TOP_FILES or token.split("/", 1)[0] in TOP_DIRS and "/" in token


@cache
def _defined_names(path: Path) -> frozenset[str]:
    """Every class, function and assigned name in a Python file, at any depth."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return frozenset(names)


def _path_problem(token: str) -> str | None:
    """Why a repository path token is false, or None."""
    if any(c in token for c in "<>*{}$"):
        return None  # a pattern such as trainer/architectures/<arch>/, not one path
    path_part, *names = token.split("::")
    path_part = re.sub(r"\[[^\]]*\]$", "", path_part)
    path = ROOT / path_part
    if not path.exists():
        return f"{path_part} does not exist"
    if path_part.endswith("/") and not path.is_dir():
        return f"{path_part} is not a folder"
    for name in names:
        for part in re.sub(r"\[[^\]]*\]$", "", name).split("."):
            if part not in _defined_names(path):
                return f"{path_part} defines no {part!r}"
    return None


def _module_problem(token: str) -> str | None:
    """Why a `sparkforge.<package>...` token names no module or name, or None."""
    parts = token.split(".")[1:]
    if parts[0] not in PACKAGE_DIRS:
        return f"{token}: sparkforge has no package {parts[0]!r}"
    where = ROOT / PACKAGE_DIRS[parts[0]]
    rest = parts[1:]
    while rest and ((where / rest[0]).is_dir() or (where / f"{rest[0]}.py").exists()):
        where = where / rest[0] if (where / rest[0]).is_dir() else where / f"{rest[0]}.py"
        rest = rest[1:]
    module = where / "__init__.py" if where.is_dir() else where
    missing = [name for name in rest if name not in _defined_names(module)]
    return f"{token}: {module.relative_to(ROOT)} defines no {missing[0]!r}" if missing else None


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = _FENCE.sub("", path.read_text())
    return {_slug(m) for m in re.findall(r"^#+\s+(.+)$", text, re.MULTILINE)}


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def _link_problem(readme: Path, target: str) -> str | None:
    """Why a relative Markdown link (file and optional anchor) leads nowhere, or None."""
    if re.match(r"^[a-z]+:", target):
        return None  # https:, mailto:
    file_part, _, anchor = target.partition("#")
    path = (readme.parent / file_part).resolve() if file_part else readme
    if not path.exists():
        return f"link {target}: {file_part} does not exist"
    if anchor and path.suffix == ".md" and anchor not in _anchors(path):
        return f"link {target}: {_shown(path)} has no heading #{anchor}"
    return None


def _problems(readme: Path) -> list[str]:
    text = readme.read_text()
    found = []
    for token in sorted(set(_tokens(text))):
        if _is_repo_path(token):
            found.append(_path_problem(token))
        elif _MODULE.match(token):
            found.append(_module_problem(token))
    found += [_link_problem(readme, target) for target in sorted(set(_LINK.findall(text)))]
    return [p for p in found if p]


@pytest.mark.parametrize("readme", READMES, ids=[str(p.relative_to(ROOT)) for p in READMES])
def test_every_path_module_and_link_a_readme_names_exists(readme: Path) -> None:
    """Each backticked repository path, `::` name, sparkforge module and relative link is real."""
    assert _problems(readme) == []


def test_the_checker_finds_a_false_path(tmp_path: Path) -> None:
    """A README naming a missing file, test, module name or heading is reported, each by name."""
    readme = tmp_path / "README.md"
    readme.write_text("# Top\n`trainer/no_such.py`, `tests/unit/test_layers.py::test_gone`,\n"
                      "`sparkforge.shared.layout.no_such_name`, [x](#nowhere), [y](#top)\n"
                      "```bash\npython benchmarks/missing.py --out runs/x\n```\n")
    assert _problems(readme) == [
        "benchmarks/missing.py does not exist",
        "sparkforge.shared.layout.no_such_name: shared/layout.py defines no 'no_such_name'",
        "tests/unit/test_layers.py defines no 'test_gone'",
        "trainer/no_such.py does not exist",
        "link #nowhere: README.md has no heading #nowhere",
    ]


def test_every_package_readme_is_linked_from_the_top_readme() -> None:
    """The top README is the map: it links every other README in the repository."""
    top = (ROOT / "README.md").read_text()
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in _LINK.findall(top)}
    assert [p for p in READMES if p != ROOT / "README.md" and p not in linked] == []


@cache
def _vllm_importers() -> frozenset[str]:
    """Library files that import vllm (at any depth, type-checking imports left out)."""
    found = set()
    for path in sorted((ROOT / "producer").rglob("*.py")) + sorted((ROOT / "shared").rglob("*.py")):
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and ast.unparse(node.test).endswith("TYPE_CHECKING") for n in ast.walk(node)}
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if id(node) not in typing_only and any(n.split(".")[0] == "vllm" for n in names):
                found.add(str(path.relative_to(ROOT)))
    return frozenset(found)


@pytest.mark.parametrize("readme", ["README.md", "producer/README.md"])
def test_the_readmes_name_every_module_that_imports_vllm(readme: str) -> None:
    """The sentence 'vLLM is imported only in ...' names exactly the files that import it."""
    text = " ".join((ROOT / readme).read_text().split())
    sentence = re.search(r"vLLM is imported only in (.+?)(?:, Lightning|\.\s)", text)
    assert sentence, f"{readme} no longer says where vLLM is imported"
    assert set(re.findall(r"`(producer/\w+\.py)`", sentence[1])) == _vllm_importers()


def test_the_architecture_table_has_a_row_per_serving_format() -> None:
    """trainer/README's table of draft architectures lists each (architecture, layout) of the
    table in trainer/architectures, so adding one means adding its row."""
    from sparkforge.trainer.architectures import ARCHITECTURES

    text = (ROOT / "trainer" / "README.md").read_text().split("## The draft architectures")[1]
    rows = re.findall(r"^\| `(\w+)`[^|]*\| `(\w+)`", text.split("\n## ")[0], re.MULTILINE)
    assert sorted(rows) == sorted((name, layout) for name, arch in ARCHITECTURES.items()
                                  for layout in arch.formats)

"""Structure figures of the library code: sizes, long functions, import cycles, extension cost.

Reads a checkout's source with ``ast`` (nothing is imported or run), so the same command measures
any commit:

    .venv/bin/python -P benchmarks/code_stats.py [--repo DIR] [--json]

Library code is every ``.py`` file under the folders of ``pyproject.toml``'s
``[tool.setuptools.package-dir]`` (tests and benchmarks are not library code). It prints:

- module lines (physical lines per file; ``__init__.py`` files of under 10 lines left out) and
  function lines (every ``def``, methods and nested ones included, from ``def`` to its last line,
  docstring included, decorators not): count, median, p90, max, the longest functions and the
  functions with the most parameters;
- modules per package folder (how flat each folder is);
- import cycles: the strongly connected groups of the graph of ``sparkforge`` imports, once with
  every import that can run (lazy ones inside functions included, ``if TYPE_CHECKING:`` left
  out) and once with module-level imports only (the cycles that import time itself walks);
- what adding a draft architecture or a target family touches: the files of each architecture's
  folder under ``trainer/architectures/`` (new files for a new one) and the library files outside
  it that import that folder, or the trainer files that spell the architecture's name as a string
  (files a new one edits); for each target family of ``shared/target_families.py``, the library
  files outside the architecture folders that spell one of its ``model_type`` strings (1: the
  table alone). READMEs and tests are not counted.

Importing a module also runs its parent packages' ``__init__.py``; those implicit edges are not
drawn, only the imports the code writes.
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import sys
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TINY_INIT_LINES = 10
"""``__init__.py`` files shorter than this only mark a package and are not counted as modules."""


@dataclass
class Module:
    """One library file: its dotted name, path, text and syntax tree."""

    name: str
    path: Path
    rel: str
    lines: int
    tree: ast.Module
    imports: dict[str, bool] = field(default_factory=dict)
    """Imported ``sparkforge`` module -> whether some import of it runs at module level."""


def package_dirs(repo: Path) -> dict[str, str]:
    """``pyproject.toml``'s package-dir mapping: dotted package -> folder."""
    pyproject = tomllib.loads((repo / "pyproject.toml").read_text())
    mapping: dict[str, str] = pyproject["tool"]["setuptools"]["package-dir"]
    return mapping


def load_modules(repo: Path) -> dict[str, Module]:
    """Every library file, named by the longest package-dir folder that holds it."""
    mapping = sorted(package_dirs(repo).items(), key=lambda kv: -len(kv[1]))
    modules: dict[str, Module] = {}
    for package, folder in mapping:
        for path in sorted((repo / folder).rglob("*.py")):
            rel = path.relative_to(repo).as_posix()
            owner = next(p for p, f in mapping if rel.startswith(f + "/"))
            if owner != package:
                continue
            parts = list(path.relative_to(repo / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([package, *parts])
            text = path.read_text()
            modules[name] = Module(name=name, path=path, rel=rel, lines=len(text.splitlines()),
                                   tree=ast.parse(text, rel))
    return modules


def _type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _import_nodes(tree: ast.Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import that can run, with whether it runs at module level (not in a def)."""
    stack: list[tuple[ast.AST, bool]] = [(tree, True)]
    while stack:
        node, top = stack.pop()
        if _type_checking_block(node):
            stack.extend((child, top) for child in getattr(node, "orelse", []))
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, top
        inner = top and not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        stack.extend((child, inner) for child in ast.iter_child_nodes(node))


def resolve_imports(modules: Mapping[str, Module]) -> None:
    """Fill each module's ``imports`` with the library modules it names."""
    for mod in modules.values():
        for node, top in _import_nodes(mod.tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative import: resolve against the module's package
                    pkg = mod.name.split(".")
                    pkg = pkg[:len(pkg) - node.level + (mod.path.name == "__init__.py")]
                    base = ".".join([*pkg, *([base] if base else [])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != mod.name:
                    mod.imports[target] = mod.imports.get(target, False) or top


def strongly_connected(graph: Mapping[str, Sequence[str]]) -> list[list[str]]:
    """Tarjan's groups of more than one module, each sorted, largest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(groups, key=lambda g: (-len(g), g))


def import_cycles(modules: Mapping[str, Module], *, top_only: bool) -> list[dict[str, Any]]:
    """The cycles of the import graph, each with its edges (``lazy`` marks a function import)."""
    graph = {m.name: [t for t, top in m.imports.items() if top or not top_only]
             for m in modules.values()}
    cycles = []
    for group in strongly_connected(graph):
        members = set(group)
        edges = [f"{m} -> {t}" + ("" if modules[m].imports[t] else " (lazy)")
                 for m in group for t in graph[m] if t in members]
        cycles.append({"modules": group, "edges": sorted(edges)})
    return cycles


def functions(modules: Mapping[str, Module]) -> list[dict[str, Any]]:
    """Every ``def``: where, how many lines, how many parameters (``self``/``cls`` excluded)."""
    found = []
    for mod in modules.values():
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                a = node.args
                params = [p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs]]
                params += [p.arg for p in (a.vararg, a.kwarg) if p is not None]
                params = [p for p in params if p not in ("self", "cls")]
                found.append({"where": f"{mod.rel}::{node.name}",
                              "lines": (node.end_lineno or node.lineno) - node.lineno + 1,
                              "params": len(params)})
    return found


def summary(values: Sequence[int]) -> dict[str, float]:
    """Count, median, p90 (nearest rank) and max."""
    ordered = sorted(values)
    p90 = ordered[max(0, -(-9 * len(ordered) // 10) - 1)] if ordered else 0
    return {"count": len(ordered), "median": statistics.median(ordered) if ordered else 0,
            "p90": p90, "max": ordered[-1] if ordered else 0}


def _string_constants(tree: ast.Module) -> set[str]:
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)}


def architecture_cost(repo: Path, modules: Mapping[str, Module]) -> dict[str, Any]:
    """Per architecture folder: its files, and the library files outside it that name it."""
    root = "trainer/architectures"
    cost = {}
    for folder in sorted(p for p in (repo / root).iterdir() if (p / "__init__.py").is_file()):
        arch, prefix = folder.name, f"{root}/{folder.name}/"
        own = sorted(m.rel for m in modules.values() if m.rel.startswith(prefix))
        package = next(m.name for m in modules.values() if m.rel == prefix + "__init__.py")
        edited = sorted(m.rel for m in modules.values() if not m.rel.startswith(prefix) and (
            any(t == package or t.startswith(package + ".") for t in m.imports)
            or (m.rel.startswith("trainer/") and arch in _string_constants(m.tree))))
        cost[arch] = {"files": own, "named_outside": edited}
    return cost


def family_cost(repo: Path, modules: Mapping[str, Module]) -> dict[str, Any]:
    """Per target family of the family table: the library files spelling its model types."""
    table = next(m for m in modules.values() if m.rel == "shared/target_families.py")
    cost = {}
    for node in ast.walk(table.tree):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "TargetFamily"):
            continue
        kw = {k.arg: k.value for k in node.keywords}
        name = ast.literal_eval(kw["name"])
        model_types = set(ast.literal_eval(kw["model_types"]))
        cost[name] = sorted(m.rel for m in modules.values()
                            if not m.rel.startswith("trainer/architectures/")
                            and model_types & _string_constants(m.tree))
    return cost


def measure(repo: Path) -> dict[str, Any]:
    """Every figure of this script for the checkout at ``repo``."""
    modules = load_modules(repo)
    resolve_imports(modules)
    counted = [m for m in modules.values()
               if not (m.path.name == "__init__.py" and m.lines < TINY_INIT_LINES)]
    fns = functions(modules)
    folders: dict[str, int] = {}
    for m in counted:
        folders[m.path.parent.relative_to(repo).as_posix()] = \
            folders.get(m.path.parent.relative_to(repo).as_posix(), 0) + 1
    return {
        "repo": str(repo),
        "modules": summary([m.lines for m in counted]) | {
            "total_lines": sum(m.lines for m in counted),
            "over_300": sorted(f"{m.rel} {m.lines}" for m in counted if m.lines > 300)},
        "functions": summary([f["lines"] for f in fns]) | {
            "over_40": sum(f["lines"] > 40 for f in fns),
            "over_80": sum(f["lines"] > 80 for f in fns),
            "longest": [f"{f['where']} {f['lines']}"
                        for f in sorted(fns, key=lambda f: -f["lines"])[:8]],
            "most_params": [f"{f['where']} {f['params']}"
                            for f in sorted(fns, key=lambda f: -f["params"])[:8]]},
        "modules_per_folder": dict(sorted(folders.items(), key=lambda kv: -kv[1])),
        "import_cycles": import_cycles(modules, top_only=False),
        "import_cycles_at_import_time": import_cycles(modules, top_only=True),
        "add_architecture": architecture_cost(repo, modules),
        "add_target_family": family_cost(repo, modules),
    }


def _stat_line(name: str, s: Mapping[str, Any]) -> str:
    return (f"{name:<10} {s['count']:>5}  median {s['median']:>5g}  p90 {s['p90']:>4}  "
            f"max {s['max']:>4}")


def report(figures: Mapping[str, Any]) -> str:
    """The figures as text."""
    m, f = figures["modules"], figures["functions"]
    lines = [f"library code of {figures['repo']}", _stat_line("modules", m)
             + f"  ({m['total_lines']:,} lines; {len(m['over_300'])} over 300)",
             _stat_line("functions", f) + f"  ({f['over_40']} over 40 lines, {f['over_80']} "
             "over 80)", "", "modules over 300 lines: " + ", ".join(m["over_300"]),
             "longest functions: " + ", ".join(f["longest"]),
             "most parameters: " + ", ".join(f["most_params"]), "",
             "modules per folder: " + ", ".join(
                 f"{k} {v}" for k, v in figures["modules_per_folder"].items() if v >= 5), ""]
    for key, title in (("import_cycles", "import cycles (lazy imports included)"),
                       ("import_cycles_at_import_time", "import cycles at import time")):
        cycles = figures[key]
        lines.append(f"{title}: {len(cycles)}")
        for c in cycles:
            lazy = [e.replace("sparkforge.", "") for e in c["edges"] if e.endswith("(lazy)")]
            lines.append(f"  {len(c['modules'])} modules, {len(c['edges'])} edges, closed by "
                         f"{len(lazy)} lazy: {'; '.join(lazy)}")
    lines += ["", "adding a draft architecture (files of its folder; library files outside it "
              "naming it):"]
    for arch, cost in figures["add_architecture"].items():
        lines.append(f"  {arch:<12} {len(cost['files'])} files; {len(cost['named_outside'])} "
                     f"outside: {', '.join(cost['named_outside'])}")
    lines.append("adding a target family (library files spelling its model_type):")
    for name, files in figures["add_target_family"].items():
        lines.append(f"  {name:<14} {len(files)}: {', '.join(files)}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the figures of ``--repo`` (default: this checkout)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    figures = measure(args.repo.resolve())
    print(json.dumps(figures, indent=1) if args.json else report(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())

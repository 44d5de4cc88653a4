"""The package's imports run one way (docs/architecture.md).

Layers, lowest first; a module may import its own layer's packages and the
layers below, never a layer above. Inside one layer the packages must not
import each other in a cycle. The check reads every ``import`` statement with
``ast`` (including the ones inside functions: an import kept local for start-up
time still counts as an edge).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "dspark"

LAYERS: list[set[str]] = [
    {"errors", "tables", "presets", "extras"},
    {"sampling", "modeling"},
    {"target"},
    {"drafters"},
    {"cli_options"},  # the flags every command shares: maps argparse onto target loading and DraftingOptions
    {"generation", "scheduler"},
    {"data", "training", "evaluation", "serving", "simulate", "export"},
    {"bench", "studies"},
    {"cli", "cli_reference", "api", "__main__"},
]
RANK = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def _package_of(module: str) -> str | None:
    """'dspark.drafters.dspark.model' -> 'drafters'; 'dspark' itself -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "dspark" else None


def _module_name(path: Path, root: Path = SRC) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, root: Path = SRC) -> list[tuple[int, str]]:
    """(line, imported module) for every dspark import in a file, relative ones resolved."""
    module = _module_name(path, root)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((node.lineno, name))
            # `from dspark import studies` imports the subpackage itself
            if name == "dspark":
                found += [(node.lineno, f"dspark.{alias.name}") for alias in node.names]
    return [(line, name) for line, name in found if name == "dspark" or name.startswith("dspark.")]


def _edges(root: Path = SRC) -> list[tuple[str, str, str, int]]:
    """(importing package, imported package, file, line) across packages."""
    edges = []
    for path in sorted(root.rglob("*.py")):
        src_pkg = _package_of(_module_name(path, root))
        for line, name in _imports(path, root):
            dst_pkg = _package_of(name)
            if src_pkg and dst_pkg and dst_pkg != src_pkg:
                edges.append((src_pkg, dst_pkg, str(path.relative_to(root.parent)), line))
    return edges


def _upward(root: Path = SRC) -> list[str]:
    return [f"{file}:{line}: {src} imports {dst}" for src, dst, file, line in _edges(root) if RANK[dst] > RANK[src]]


def test_every_package_has_a_layer():
    packages = {p.stem if p.is_file() else p.name for p in SRC.iterdir()
                if (p.is_dir() and (p / "__init__.py").is_file()) or (p.suffix == ".py" and p.stem != "__init__")}
    packages -= {"configs", "eval_data"}
    missing = sorted(packages - set(RANK))
    assert not missing, f"packages without a layer in tests/test_architecture.py: {missing}"


def test_imports_run_one_way():
    upward = _upward()
    assert not upward, "imports that run against the layers:\n" + "\n".join(upward)


def test_no_cycles_inside_a_layer():
    graph = defaultdict(set)
    for src, dst, _, _ in _edges():
        if RANK[src] == RANK[dst]:
            graph[src].add(dst)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})) for nxt in graph.get(start, ()))

    cycles = sorted(f"{a} <-> {b}" for a in graph for b in graph[a] if reaches(b, a, {b}))
    assert not cycles, f"packages of one layer that import each other: {cycles}"


def _argparse_users(root: Path) -> list[str]:
    return [str(path.relative_to(root.parent)) for path in sorted(root.rglob("*.py"))
            if any(isinstance(node, (ast.Import, ast.ImportFrom))
                   and "argparse" in ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module])
                   for node in ast.walk(ast.parse(path.read_text(), str(path))))]


def test_the_library_below_the_commands_knows_nothing_of_argparse():
    """sampling, modeling, target and drafters take values, not parsed flags (the flags: dspark.cli_options)."""
    found = [f for pkg in ("sampling", "modeling", "target", "drafters") for f in _argparse_users(SRC / pkg)
             if not f.endswith("/cli.py")]
    assert not found, f"library modules that import argparse: {found}"


def test_the_argparse_check_sees_an_import(tmp_path):
    """Negative control: a drafter module that imports argparse is reported."""
    (tmp_path / "drafters").mkdir()
    (tmp_path / "drafters" / "options.py").write_text("from argparse import Namespace\n")
    assert _argparse_users(tmp_path / "drafters") == ["drafters/options.py"]


@pytest.mark.parametrize("statement", ["import dspark.cli", "from dspark.serving import server",
                                       "from ...serving.server import Server", "from dspark import studies"])
def test_the_check_catches_an_upward_import_hidden_in_a_function(tmp_path, statement):
    """Negative control: a drafter module that imports a higher layer inside a function is reported."""
    pkg = tmp_path / "dspark" / "drafters" / "dspark"
    pkg.mkdir(parents=True)
    for folder in (tmp_path / "dspark", tmp_path / "dspark" / "drafters", pkg):
        (folder / "__init__.py").write_text("")
    (pkg / "model.py").write_text(f"from dspark.target.model import TargetModel\n\ndef load():\n    {statement}\n")
    found = _upward(tmp_path / "dspark")
    assert len(found) == 1 and found[0].startswith("dspark/drafters/dspark/model.py:4: drafters imports"), found

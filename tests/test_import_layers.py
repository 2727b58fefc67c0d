"""Imports point one way: every module of sartor/ is read with `ast` (imports at module level and
inside functions, relative imports resolved) and each import is checked against the layer table
below: a package may import its own layer and the layers under it, never one above. Also: no
module imports another module's private (`_name`) names, and no two modules import each other
round a circle, except under `if TYPE_CHECKING:`."""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

SARTOR = Path(__file__).resolve().parent.parent / "sartor"
ROOT = "package root"  # sartor/__init__.py and sartor/__main__.py

# Bottom first. A package imports only packages of its own layer or lower ones.
LAYERS = (
    ("foundations", ("errors", "extras", "version", "progress", "ir", "ops", "kernels", "data")),
    ("graph and runtime", ("frontend", "passes", "runtime", "pipeline")),
    ("tactic selection", ("tactics",)),
    # Calibration and quantization math: no builder, cli, serve, validate or package root.
    ("quantization", ("quant",)),
    ("validation", ("validate",)),
    ("applications", ("builder", "deploy", "serve", "integrations")),
    ("command line", ("cli",)),
    ("public API", (ROOT,)),
)
RANK = {package: rank for rank, (_, packages) in enumerate(LAYERS) for package in packages}
LAYER_NAME = {package: name for name, packages in LAYERS for package in packages}

@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module (a package's __init__ counts as the package)
    names: tuple  # the names taken from it (empty for `import x`)
    line: int
    type_checking: bool  # inside `if TYPE_CHECKING:`


def module_name(path: Path, package_dir: Path = SARTOR) -> str:
    parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str:
    """The top-level package of sartor a module belongs to (sartor.quant.data → quant)."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return ROOT
    return parts[1]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def read_imports(module: str, source: str, is_package: bool = False, known: frozenset = frozenset()) -> list[Import]:
    """Every import of sartor modules in `source` (the text of `module`), at any depth. A name
    taken from a package that is itself a module in `known` (`from . import families`) counts as
    an import of that module."""
    found: list[Import] = []
    base = module.split(".") if is_package else module.split(".")[:-1]

    def visit(node: ast.AST, type_checking: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, type_checking)
            return
        if isinstance(node, ast.ImportFrom):
            if node.level:
                kept = base[:len(base) - (node.level - 1)]
                target = ".".join(kept + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "sartor" or target.startswith("sartor."):
                submodules = [a.name for a in node.names if f"{target}.{a.name}" in known]
                names = tuple(a.name for a in node.names if a.name not in submodules)
                for name in submodules:
                    found.append(Import(module, f"{target}.{name}", (), node.lineno, type_checking))
                if names:
                    found.append(Import(module, target, names, node.lineno, type_checking))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "sartor" or alias.name.startswith("sartor."):
                    found.append(Import(module, alias.name, (), node.lineno, type_checking))
        for child in ast.iter_child_nodes(node):
            visit(child, type_checking)

    visit(ast.parse(source), False)
    return found


def layer_violations(imports: list[Import], where: str) -> list[str]:
    """One line per import of a higher layer, or of a package the table does not place."""
    problems = []
    for edge in imports:
        low, high = package_of(edge.source), package_of(edge.target)
        for package in (low, high):
            if package not in RANK:
                problems.append(f"{where}:{edge.line}: package {package!r} is in no layer of "
                                f"tests/test_import_layers.py LAYERS")
        if low in RANK and high in RANK and RANK[high] > RANK[low]:
            problems.append(f"{where}:{edge.line}: {edge.source} ({LAYER_NAME[low]}) imports {edge.target} "
                            f"({LAYER_NAME[high]}), a higher layer")
    return problems


def private_name_imports(imports: list[Import], where: str) -> list[str]:
    """One line per private name imported from another module."""
    problems = []
    for edge in imports:
        if edge.target == edge.source:
            continue
        private = [n for n in edge.names if n.startswith("_") and not (n.startswith("__") and n.endswith("__"))]
        if private:
            problems.append(f"{where}:{edge.line}: {edge.source} imports private {', '.join(private)} from "
                            f"{edge.target}")
    return problems


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (or a module importing itself), each
    as a list of module names, sorted (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, groups = {}, {}, set(), [], []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1 or node in edges.get(node, ()):
                    groups.append(sorted(group))
    return sorted(groups)


def sartor_imports() -> dict[Path, list[Import]]:
    paths = sorted(SARTOR.rglob("*.py"))
    known = frozenset(module_name(p) for p in paths)
    return {p: read_imports(module_name(p), p.read_text(), p.name == "__init__.py", known) for p in paths}


# ---- the checker on made-up modules: it must be able to fail -----------------------------------------------

def test_checker_names_file_line_and_edge_of_an_upward_import():
    source = "import numpy\n\ndef plan(config):\n    from ..builder.config import BuildConfig\n    return config\n"
    imports = read_imports("sartor.quant.fake", source)
    assert imports == [Import("sartor.quant.fake", "sartor.builder.config", ("BuildConfig",), 4, False)]
    assert layer_violations(imports, "sartor/quant/fake.py") == [
        "sartor/quant/fake.py:4: sartor.quant.fake (quantization) imports sartor.builder.config (applications), "
        "a higher layer"]


def test_checker_refuses_the_package_root_and_cli_from_quant_but_not_downward_imports():
    source = "import sartor\nfrom sartor.cli.common import console\nfrom ..runtime.executor import Executor\n"
    problems = layer_violations(read_imports("sartor.quant.fake", source), "fake.py")
    assert [p.split(":")[1] for p in problems] == ["1", "2"]
    assert not layer_violations(read_imports("sartor.builder.fake", "from ..quant import calibrate\n"), "fake.py")


def test_checker_resolves_relative_imports_of_packages_and_submodules():
    known = frozenset({"sartor.ops", "sartor.ops.families"})
    imports = read_imports("sartor.ops", "from . import families\nfrom .util import x\n", is_package=True, known=known)
    assert [(i.target, i.names) for i in imports] == [("sartor.ops.families", ()), ("sartor.ops.util", ("x",))]


def test_checker_finds_private_names_and_unplaced_packages():
    imports = read_imports("sartor.builder.fake", "from ..quant.data import _spread, open_calibration, __all__\n")
    assert private_name_imports(imports, "fake.py") == [
        "fake.py:1: sartor.builder.fake imports private _spread from sartor.quant.data"]
    assert "in no layer" in layer_violations(read_imports("sartor.newpkg.fake", "from ..ir import Graph\n"), "f.py")[0]


def test_checker_finds_cycles_and_ignores_type_checking_imports():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\nfrom .c import C\n"
    imports = read_imports("sartor.quant.a", source)
    assert [(i.target, i.type_checking) for i in imports] == [("sartor.quant.b", True), ("sartor.quant.c", False)]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


# ---- sartor itself -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def imports() -> dict[Path, list[Import]]:
    return sartor_imports()


def test_no_package_imports_a_higher_layer(imports):
    problems = [line for path, found in imports.items()
                for line in layer_violations(found, str(path.relative_to(SARTOR.parent)))]
    assert not problems, "imports that point up the layers:\n" + "\n".join(problems)


def test_no_module_imports_another_modules_private_names(imports):
    problems = [line for path, found in imports.items()
                for line in private_name_imports(found, str(path.relative_to(SARTOR.parent)))]
    assert not problems, "private names imported across modules:\n" + "\n".join(problems)


def test_no_import_cycle_outside_type_checking(imports):
    edges: dict[str, set[str]] = {}
    for found in imports.values():
        for edge in found:
            if not edge.type_checking and edge.target != edge.source:
                edges.setdefault(edge.source, set()).add(edge.target)
    cycles = import_cycles(edges)
    assert not cycles, "modules that import each other round a circle:\n" + "\n".join(" ↔ ".join(c) for c in cycles)

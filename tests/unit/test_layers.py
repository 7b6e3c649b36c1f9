"""The tree shows its layers: no module imports a layer above its own, and no modules import each other in a circle.

Read from the source (every ``import``, inside functions too), so a lazy
import counts like any other.
"""

from __future__ import annotations

import ast
import os
from typing import Dict, List, Set

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "mpiopt")

#: Bottom up: a module may import its own layer and those below (CONTRIBUTING.md, "Architecture").
LAYERS = [
    {"_version", "arrays"},
    {"comm", "kernels"},
    {"codecs"},  # pure array code on the kernels; tests/unit/test_codecs.py keeps them off comm
    {"asyncrt", "tasks"},
    {"algorithms"},
    {"sim"},
    {"torch", "metrics", "checkpoint"},
    {"training"},
    {"bench", "experiments", "cli"},
    {"__init__", "__main__"},
]
LAYER = {part: level for level, parts in enumerate(LAYERS) for part in parts}
#: tasks (workloads) stand beside the algorithms but use nothing above the kernels.
CEILING = {"tasks": LAYER["kernels"]}


def _modules() -> Dict[str, str]:
    """Dotted name -> path of every module of the package."""
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
                found[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return found


def _imports(module: str, path: str, modules: Dict[str, str]) -> Set[str]:
    """The mpiopt modules ``module`` imports (a package's ``from . import x`` names the submodule where one exists)."""
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out = set()
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
                       if not _is_extension(base, alias.name)]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target.startswith("mpiopt") and target != module:
                out.add(target)
    return out


def _is_extension(package: str, name: str) -> bool:
    """Whether ``package.name`` is a compiled extension (a C source beside the package's modules)."""
    folder = os.path.join(os.path.dirname(PACKAGE), *package.split("."))
    return os.path.exists(os.path.join(folder, f"{name}.c"))


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _graph() -> Dict[str, Set[str]]:
    modules = _modules()
    return {module: _imports(module, path, modules) for module, path in modules.items()}


def test_every_package_has_a_layer():
    assert {_part(m) for m in _graph()} <= set(LAYER)


def test_no_module_imports_a_layer_above_its_own():
    wrong: List[str] = []
    for module, targets in _graph().items():
        part = _part(module)
        ceiling = CEILING.get(part, LAYER[part])
        for target in targets:
            other = _part(target)
            if other != part and LAYER[other] > ceiling:
                wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_circles():
    graph = _graph()
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    circles: List[List[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    # A package's __init__ re-exports its modules, which import each other's names through it: count circles
    # between modules proper, with the packages' __init__ left out.
    proper = [c for c in circles if len([m for m in c if not _is_package(m)]) > 1]
    assert not proper, proper


def _is_package(module: str) -> bool:
    return _modules()[module].endswith("__init__.py")

"""Imports flow one way: the library (hidup) never imports the commands' packages (simulator,
calibration, experiments), and no module or package imports itself back through others. The
imports are read with `ast`, those inside functions included."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("hidup", "simulator", "calibration", "experiments")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The project's modules that module `name` imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    named: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            named.add(base)
            named.update(f"{base}.{alias.name}" for alias in node.names)
    out = set()
    for target in named:
        while target and target not in MODULES:  # a name inside a module: the module
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _package(module: str) -> str:
    """The package a module belongs to (a package's __init__ belongs to the package itself)."""
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0] or module


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_reader_sees_imports_inside_functions(tmp_path):
    """The walk finds an import hidden in a function, and a cycle made of one."""
    path = tmp_path / "mod.py"
    path.write_text("def f():\n    from simulator.predict import simulate\n")
    MODULES["hidup.fake"] = path
    try:
        assert "simulator.predict" in _imports("hidup.fake", path)
    finally:
        del MODULES["hidup.fake"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_library_imports_no_command_package():
    wrong = {name: sorted(d for d in deps if not d.startswith("hidup"))
             for name, deps in GRAPH.items() if name.startswith("hidup")}
    assert not {name: deps for name, deps in wrong.items() if deps}


@pytest.mark.parametrize("level", ["module", "package"])
def test_no_import_cycle(level):
    if level == "module":
        graph = GRAPH
    else:
        graph = {}
        for name, deps in GRAPH.items():
            mine = _package(name)
            for dep in deps:
                theirs = _package(dep)
                # a package's __init__ may gather its own sub-packages' names
                own = MODULES[name].name == "__init__.py" and theirs.startswith(mine + ".")
                if theirs != mine and not own:
                    graph.setdefault(mine, set()).add(theirs)
    assert _cycles(graph) == []

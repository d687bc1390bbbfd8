"""Imports run one way: flows -> stages -> methods -> core, with eval/ scripts on top and the
runtime (kibidango) importable by all and importing none of them. Inside the runtime: the
decoding core and the bundle -> ``kibidango.cascade`` -> ``kibidango.server`` -> the CLI. No stage
imports another stage, and no two modules import each other, however indirectly. Every import
statement of every module is read (function-level imports included), so a new import that runs
back up a floor or closes a circle fails here with its file and line."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

FLOOR = {"core": 0, "methods": 1, "stages": 2, "flows": 3, "eval": 3}
"""A module may import from its own floor and the floors below; flows and eval do not import each other."""


def _imports(path: Path, package: str) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: inside its own package
                out.append((node.lineno, package))
            elif node.module:
                out.append((node.lineno, node.module))
    return out


def _modules(package: str):
    root = REPO / ("runtime/kibidango" if package == "kibidango" else package)
    return sorted(root.rglob("*.py"))


def _name(path: Path) -> str:
    rel = path.relative_to(REPO / "runtime" if path.is_relative_to(REPO / "runtime") else REPO).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _graph() -> dict[str, dict[str, int]]:
    """module -> {module it imports (itself a module of this repository): line}. ``from a import b``
    counts as an import of ``a.b`` when that is a module, else of ``a``; relative imports resolve."""
    paths = {_name(p): p for package in [*FLOOR, "kibidango"] for p in _modules(package)}
    graph: dict[str, dict[str, int]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
            for t in targets:
                if t in paths and t != name:
                    edges.setdefault(t, node.lineno)
        graph[name] = edges
    return graph


RUNTIME_FLOOR = {
    "kibidango.integrity": 0,
    "kibidango.backends": 1,
    "kibidango.decode": 2,
    "kibidango.addons": 2,
    "kibidango.paid": 2,
    "kibidango.bundle": 3,
    "kibidango.pipeline": 4,
    "kibidango.tools": 5,
    "kibidango.cascade": 5,
    "kibidango.server": 6,
    "kibidango.cli": 7,
}
"""The runtime's floors are its folders: the bundle's integrity errors (0), ``backends/`` (1: a
model and its sessions), ``decode/`` (the decoding core), ``addons/`` (router, adapters,
confidence: what a request adds) and ``paid/`` (the one paid client and its ledger) (2), ``bundle/``
(the loader, its manifest schema, packs and the registry: 3), the Python API ``pipeline`` (4),
``tools/`` (bench, tune) and ``cascade/`` (5), ``server/`` (6), the CLI (7). A module imports only
its own folder and lower floors: a backend that reached up into the decoding core (the llama.cpp
draft hook once imported a private helper of kibidango.decode.speculative) fails here, and so does
one folder reaching into another on its floor. A module outside every folder named here fails
:func:`test_every_runtime_module_has_a_floor`: a new module is placed on a floor, not left flat."""
API_FLOOR = 4
"""``kibidango`` itself (its ``__init__``) re-exports the API: the bundle, the pipeline, the decoder."""


def _runtime_home(module: str) -> str | None:
    """The folder (or top-level module) of RUNTIME_FLOOR that ``module`` lives in."""
    if module == "kibidango.__main__":  # ``python -m kibidango``: the CLI's entry
        return "kibidango.cli"
    for prefix in RUNTIME_FLOOR:
        if module == prefix or module.startswith(prefix + "."):
            return prefix
    return None


def _runtime_floor(module: str) -> int:
    if module == "kibidango":
        return API_FLOOR
    home = _runtime_home(module)
    if home is None:
        raise KeyError(f"{module}: on no floor of RUNTIME_FLOOR")
    return RUNTIME_FLOOR[home]


def test_every_runtime_module_has_a_floor():
    flat = [m for m in _graph() if m.startswith("kibidango.") and _runtime_home(m) is None]
    assert not flat, f"runtime modules on no floor (place them in a folder of RUNTIME_FLOOR): {flat}"


def test_every_import_goes_down_a_floor_or_stays():
    wrong = []
    for package, floor in FLOOR.items():
        for path in _modules(package):
            for line, target in _imports(path, package):
                top = target.split(".")[0]
                if top in FLOOR and (FLOOR[top] > floor or (top != package and FLOOR[top] == floor)):
                    wrong.append(
                        f"{path.relative_to(REPO)}:{line}: {package} (floor {floor}) imports {target} (floor "
                        f"{FLOOR[top]})"
                    )
    assert not wrong, "\n".join(wrong)


def test_the_runtime_imports_nothing_of_the_pipeline():
    wrong = []
    for path in _modules("kibidango"):
        for line, target in _imports(path, "kibidango"):
            if target.split(".")[0] in FLOOR:
                wrong.append(f"{path.relative_to(REPO)}:{line}: imports {target}")
    assert not wrong, "\n".join(wrong)


def test_the_runtime_has_no_import_cycle_between_bundle_and_pack():
    pack = {t for _, t in _imports(REPO / "runtime/kibidango/bundle/pack.py", "kibidango")}
    assert "kibidango.bundle" not in pack


def _upward(graph: dict[str, dict[str, int]]) -> list[str]:
    """Every import in ``graph`` (module -> {imported module: line}) from a runtime floor to a higher one."""
    wrong = []
    for module, edges in graph.items():
        if not module.startswith("kibidango"):
            continue
        for target, line in edges.items():
            if not target.startswith("kibidango.") or _runtime_home(target) is None or _runtime_home(module) is None:
                continue
            here, there = _runtime_floor(module), _runtime_floor(target)
            if there > here or (there == here and _runtime_home(target) != _runtime_home(module)):
                wrong.append(f"{module}:{line}: floor {here} imports {target} (floor {there})")
    return wrong


def test_the_runtime_floors_import_only_downward():
    """The backends never import the decoding core; the decoding core and the bundle never import
    the cascade or the server (so editing either changes no stage's code version); the cascade
    never imports the server."""
    wrong = _upward(_graph())
    assert not wrong, "\n".join(wrong)


def test_the_floor_check_catches_an_upward_import():
    """A test of the test: the imports it was blind to (a backend reaching into the decoding core,
    a lazy import inside a function) are found."""
    assert _upward({"kibidango.backends.llamacpp_backend": {"kibidango.decode.speculative": 272}}) == [
        "kibidango.backends.llamacpp_backend:272: floor 1 imports kibidango.decode.speculative (floor 2)"
    ]
    assert _upward({"kibidango.pipeline": {"kibidango.server.app": 9}, "kibidango.paid.client": {"kibidango.cli": 3}})
    assert _upward({"kibidango.addons.router": {"kibidango.decode.speculative": 5}}) == [
        "kibidango.addons.router:5: floor 2 imports kibidango.decode.speculative (floor 2)"
    ]  # another folder on the same floor
    assert not _upward({"kibidango.decode.speculative": {"kibidango.decode.ngrams": 1}})  # its own folder
    with pytest.raises(KeyError, match="kibidango.flat: on no floor"):
        _runtime_floor("kibidango.flat")
    assert not _upward({"kibidango.server.app": {"kibidango.pipeline": 1, "kibidango.backends.base": 2}})
    lazy = _graph()["kibidango.pipeline"]  # a function-level import is an edge like any other
    assert "kibidango.backends" in lazy or any(t.startswith("kibidango.backends.") for t in lazy)


def test_no_stage_imports_another_stage():
    graph = _graph()
    wrong = [
        f"{module}:{line}: imports {target}"
        for module, edges in graph.items()
        if module.startswith("stages.")
        for target, line in edges.items()
        if target.startswith("stages")
    ]
    assert not wrong, "\n".join(wrong)


def test_no_import_circle_anywhere():
    """Tarjan's strongly connected components over every import of every module: each must be a
    single module."""
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    described = [
        " <-> ".join(c) + ": " + "; ".join(f"{a}:{graph[a][b]} -> {b}" for a in c for b in graph[a] if b in c)
        for c in circles
    ]
    assert not circles, "\n".join(described)


def test_the_formatter_has_no_escapes():
    """ruff format owns the layout (line length 120, E501 enforced): no formatter escape comments."""
    marker = "fmt: " + "skip"
    escaped = [
        f"{path.relative_to(REPO)}:{n}"
        for package in [*FLOOR, "kibidango", "tests"]
        for path in (_modules(package) if package != "tests" else sorted((REPO / "tests").rglob("*.py")))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if marker in line or "fmt: " + "off" in line
    ]
    assert not escaped, "\n".join(escaped)

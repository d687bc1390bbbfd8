"""A stage's code version: a hash of exactly the code that can change its output.

Starting from the stage module, every name it uses is resolved statically (through the modules'
own imports, re-exports included) to the top-level definition it names — a function, a class, a
module-level assignment — in a project package, and so on transitively. Plumbing packages (the
store, the contract, progress reporting) are not followed: they cannot change what a stage
writes. Each definition found is normalised before hashing — its syntax tree, without
docstrings, line numbers or imports of project modules — and keyed by the name it defines, not by
the file it lives in. So a comment, a docstring, reformatting, or moving a definition to another
module keeps the version; a one-character change to a function a stage uses changes the version
of exactly the stages that reach that function. The versions of the libraries the stage declares
(``LIBRARIES``) are hashed too.

A module's top-level functions named ``report_*`` (a stage's part of the report: they read its
artifact, never write it) are presentation, not behaviour: they are left out of the module's
hash and their references are not followed, and any other definition of the module that calls
one is refused (:class:`PresentationUsed`), so a report edit never re-keys a stage and never hides
a change of what it writes.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import ModuleType

__all__ = ["PresentationUsed", "code_version", "definitions"]

PRESENTATION = "report_"  # top-level functions so named only render an artifact: not part of a code version


class PresentationUsed(ValueError):
    """A definition that a code version hashes calls a ``report_*`` function (presentation)."""


def _presentation(node: ast.stmt) -> bool:
    return isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith(PRESENTATION)


Ref = tuple[str, str]  # (module, top-level name); name "*" is the whole module


@dataclass
class _Module:
    name: str
    is_package: bool
    tree: ast.Module
    defs: dict[str, ast.stmt] = field(default_factory=dict)
    imports: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # local name -> (module, attr)


def _absolute(module: str, is_package: bool, level: int, target: str | None) -> str:
    if not level:
        return target or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join([*base, *([target] if target else [])])


def _import_names(node: ast.stmt, module: _Module) -> dict[str, tuple[str, str | None]]:
    out: dict[str, tuple[str, str | None]] = {}
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.asname:
                out[alias.asname] = (alias.name, None)
            else:  # `import a.b` binds `a`
                out[alias.name.split(".")[0]] = (alias.name.split(".")[0], None)
    elif isinstance(node, ast.ImportFrom):
        source = _absolute(module.name, module.is_package, node.level, node.module)
        for alias in node.names:
            if alias.name != "*":
                out[alias.asname or alias.name] = (source, alias.name)
    return out


@cache
def _load(name: str, source: str | None = None) -> _Module | None:
    """A module's parsed source (``source`` overrides the file, for tests)."""
    if source is None:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            return None
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            return None
        source = Path(spec.origin).read_text(encoding="utf-8")
        is_package = spec.submodule_search_locations is not None
    else:
        is_package = False
    module = _Module(name, is_package, ast.parse(source))
    for node in module.tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            module.defs[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        module.defs[n.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            module.imports.update(_import_names(node, module))
        elif isinstance(node, (ast.If, ast.Try)):  # conditional imports and definitions
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    module.imports.update(_import_names(sub, module))
                elif isinstance(sub, (ast.FunctionDef, ast.ClassDef)):
                    module.defs.setdefault(sub.name, node)
    return module


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


class _Graph:
    def __init__(self, packages: tuple[str, ...], skip: tuple[str, ...], sources: dict[str, str]):
        self.packages, self.skip, self.sources = packages, skip, sources
        self.normalised: dict[Ref, str] = {}  # what definitions() computed per reference: stages share most of them
        self.refs: dict[Ref, set[Ref]] = {}

    def project(self, module: str) -> bool:
        """A module of this project, plumbing included: its imports are not behaviour (what they
        bind is followed by name), so they are left out of the normalised form."""
        top = module.split(".")[0]
        return top in self.packages or any(top == s.split(".")[0] for s in self.skip)

    def ours(self, module: str) -> bool:
        top_ok = module.split(".")[0] in self.packages
        return top_ok and not any(module == s or module.startswith(s + ".") for s in self.skip)

    def module(self, name: str) -> _Module | None:
        return _load(name, self.sources.get(name))

    def resolve(self, module: str, name: str, local: dict[str, tuple[str, str | None]], depth: int = 0) -> Ref | None:
        """What ``name`` means in ``module``: a definition of ours, a module of ours ("*"), or None."""
        info = self.module(module)
        if info is None or depth > 20:
            return None
        if name in local:
            src, attr = local[name]
        elif name in info.defs:
            return (module, name)
        elif name in info.imports:
            src, attr = info.imports[name]
        else:
            return None
        if attr is None:
            return (src, "*") if self.ours(src) else None
        if not self.ours(src):
            return None
        if _is_module(f"{src}.{attr}"):
            return (f"{src}.{attr}", "*")
        return self.resolve(src, attr, {}, depth + 1)

    def references(self, module: str, nodes: list[ast.AST]) -> set[Ref]:
        """Definitions and modules of ours that ``nodes`` (in ``module``) use."""
        local: dict[str, tuple[str, str | None]] = {}
        info = self.module(module)
        for node in nodes:
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)) and info is not None:
                    local.update(_import_names(sub, info))
        found: set[Ref] = set()
        graph = self

        class Visitor(ast.NodeVisitor):
            def visit_Attribute(self, node: ast.Attribute) -> None:
                chain = _chain(node)
                if not chain:
                    self.generic_visit(node)
                    return
                ref = graph.resolve(module, chain[0], local)
                for attr in chain[1:]:  # a.b.c through modules of ours, down to a definition
                    if ref is None or ref[1] != "*":
                        break
                    nxt = f"{ref[0]}.{attr}"
                    ref = (nxt, "*") if _is_module(nxt) else graph.resolve(ref[0], attr, {})
                if ref is not None:
                    found.add(ref)

            def visit_Name(self, node: ast.Name) -> None:
                ref = graph.resolve(module, node.id, local)
                if ref is not None:
                    found.add(ref)

        for node in nodes:
            Visitor().visit(node)
        return found


def _chain(node: ast.Attribute) -> list[str]:
    parts: list[str] = []
    cur: ast.AST = node
    while isinstance(cur, ast.Attribute):
        parts.append(cur.attr)
        cur = cur.value
    return [cur.id, *reversed(parts)] if isinstance(cur, ast.Name) else []


def _without_docstring(body: list[ast.stmt]) -> list[ast.stmt]:
    """``body`` less its leading docstring (a module's, a class's, a function's)."""
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        body = body[1:]
    return body or [ast.Pass()]


def _behaviour(module: _Module) -> list[ast.stmt]:
    """A whole module's statements that a code version hashes: no docstring, no ``report_*``
    function."""
    return [node for node in _without_docstring(module.tree.body) if not _presentation(node)] or [ast.Pass()]


class _Normalise(ast.NodeTransformer):
    """Drop docstrings and the imports of the project's modules, plumbing included (a move rewrites
    those, not behaviour)."""

    def __init__(self, graph: _Graph, module: _Module):
        self.graph, self.module = graph, module

    def generic_visit(self, node: ast.AST) -> ast.AST:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
            node.body = _without_docstring(node.body)
        return super().generic_visit(node)

    def visit_Import(self, node: ast.Import):
        keep = [a for a in node.names if not self.graph.project(a.name)]
        if not keep:
            return None
        node.names = keep
        return node

    def visit_ImportFrom(self, node: ast.ImportFrom):
        source = _absolute(self.module.name, self.module.is_package, node.level, node.module)
        return None if self.graph.project(source) else node


def _normalised(graph: _Graph, ref: Ref) -> str:
    module = graph.module(ref[0])
    if module is None:
        return ""
    nodes = _behaviour(module) if ref[1] == "*" else [module.defs[ref[1]]]
    out = []
    for node in nodes:
        clean = _Normalise(graph, module).visit(copy.deepcopy(node))
        if clean is not None:
            out.append(ast.dump(clean, annotate_fields=False, include_attributes=False))
    return "\n".join(out)


def definitions(
    module: ModuleType | str,
    packages: tuple[str, ...],
    skip: tuple[str, ...] = (),
    sources: dict[str, str] | None = None,
) -> dict[Ref, str]:
    """Every definition (or whole module) of ``packages`` that ``module`` reaches, outside
    ``skip``, with its normalised form."""
    graph = _graph(packages, skip, sources or {})
    start = module if isinstance(module, str) else module.__name__
    todo: list[Ref] = [(start, "*")]
    seen: dict[Ref, str] = {}
    while todo:
        ref = todo.pop()
        if ref in seen:
            continue
        info = graph.module(ref[0])
        if info is None or (ref[1] != "*" and ref[1] not in info.defs):
            continue
        if ref not in graph.normalised:
            graph.normalised[ref] = _normalised(graph, ref)
            nodes = _behaviour(info) if ref[1] == "*" else [info.defs[ref[1]]]
            graph.refs[ref] = graph.references(ref[0], nodes)
        used = sorted(r[1] for r in graph.refs[ref] if r[0] == ref[0] and r[1].startswith(PRESENTATION))
        if used:
            raise PresentationUsed(
                f"{ref[0]}: {'the module' if ref[1] == '*' else ref[1]} calls {used[0]}, a report function: "
                f"{PRESENTATION}* functions only render an artifact and are not part of the code version"
            )
        seen[ref] = graph.normalised[ref]
        todo += [r for r in graph.refs[ref] if r not in seen]
    return seen


_GRAPHS: dict[tuple, _Graph] = {}


def _graph(packages: tuple[str, ...], skip: tuple[str, ...], sources: dict[str, str]) -> _Graph:
    """One graph per (packages, skip, sources): a plan's stages share most definitions, and each
    one's normalised form is computed once (sources are read once per process, as :func:`_load`
    does; a few graphs are kept, for tests that edit sources)."""
    key = (tuple(packages), tuple(skip), tuple(sorted(sources.items())))
    if key not in _GRAPHS:
        if len(_GRAPHS) >= 8:
            _GRAPHS.pop(next(iter(_GRAPHS)))
        _GRAPHS[key] = _Graph(tuple(packages), tuple(skip), dict(sources))
    return _GRAPHS[key]


def code_version(
    module: ModuleType, packages: tuple[str, ...], skip: tuple[str, ...] = (), sources: dict[str, str] | None = None
) -> str:
    """The hash described in the module docstring. ``sources`` (module name -> source text)
    replaces files, so tests can edit code without touching the tree."""
    start = module.__name__
    found = definitions(module, packages, skip, sources)
    entries = sorted(
        ("<stage>" if ref == (start, "*") else ref[1] if ref[1] != "*" else f"<module {ref[0].split('.')[-1]}>", text)
        for ref, text in found.items()
    )
    h = hashlib.sha256()
    for name, text in entries:
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    for dist in sorted(getattr(module, "LIBRARIES", ())):
        h.update(f"{dist}=={importlib.metadata.version(dist)}".encode())
    return h.hexdigest()[:16]

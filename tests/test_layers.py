"""Imports run one way: flows -> stages -> methods -> core, with eval/ scripts on top and the
runtime (kibidango) importable by all and importing none of them. Every import statement of every
module is read (function-level imports included), so a new import that runs back up a floor
fails here with its file and line."""

from __future__ import annotations

import ast
from pathlib import Path

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


def test_every_import_goes_down_a_floor_or_stays():
    wrong = []
    for package, floor in FLOOR.items():
        for path in _modules(package):
            for line, target in _imports(path, package):
                top = target.split(".")[0]
                if top in FLOOR and (FLOOR[top] > floor or (top != package and FLOOR[top] == floor)):
                    wrong.append(
                        f"{path.relative_to(REPO)}:{line}: {package} (floor {floor}) imports {target} (floor {FLOOR[top]})"
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
    pack = {t for _, t in _imports(REPO / "runtime/kibidango/pack.py", "kibidango")}
    assert "kibidango.bundle" not in pack

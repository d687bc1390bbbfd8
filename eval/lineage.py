"""Which artifacts of the workspace a measuring command reads: the newest of a stage *for a preset*
(the tiny and small presets share one store), and the artifacts a given one was built from.

An artifact's manifest lists its inputs by cache key, and the store keeps each artifact under
``<stage>/<key>``, so the walk up the inputs is exact. Stage X records the preset it bundled (its
``preset``): an artifact belongs to a preset when it is that preset's X, or when an X of the preset
is among its inputs, however far up (stage 9 -> 1F -> X)."""

from __future__ import annotations

import json
from pathlib import Path

from core.store import ArtifactStore

__all__ = ["manifest", "newest", "upstream"]


def manifest(artifact: Path) -> dict:
    return json.loads((artifact / "manifest.json").read_text())


def upstream(store: ArtifactStore, artifact: Path, stage: str) -> Path | None:
    """The artifact of ``stage`` that ``artifact`` was built from, following its inputs up;
    ``artifact`` itself if it is of ``stage``; None if none is."""
    todo, seen = [artifact], set()
    while todo:
        here = todo.pop(0)
        if here in seen or not (here / "manifest.json").is_file():
            continue
        seen.add(here)
        m = manifest(here)
        if m["stage_id"] == stage:
            return here
        for source in m.get("inputs", {}).values():
            todo += sorted(Path(store.root).glob(f"*/{source['key']}"))
    return None


def newest(store: ArtifactStore, stage: str, preset: str, need: str | None = None) -> Path | None:
    """The newest artifact of ``stage`` that belongs to ``preset`` (with input ``need``, if given)."""
    found = []
    for p in store.artifacts(stage):
        m = manifest(p)
        if need is not None and need not in m.get("inputs", {}):
            continue
        bundle = upstream(store, p, "X")
        if bundle is not None and manifest(bundle)["config"].get("preset") == preset:
            found.append(p)
    return max(found, key=lambda p: (p / "manifest.json").stat().st_mtime) if found else None

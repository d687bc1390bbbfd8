"""Which artifacts of the workspace a measuring command reads: the newest of a stage *for a preset*
(the tiny and small presets share one store), and the artifacts a given one was built from.

An artifact's manifest lists its inputs by cache key; the preset's stage graph says which stage each
input came from, so the walk is exact. Stage X records the preset it bundled (its ``preset``): an
artifact belongs to a preset when it is that preset's X, or when an X of the preset is among its
inputs, however far up (stage 9 -> 1F -> X)."""

from __future__ import annotations

import json
from pathlib import Path

from core.store import ArtifactStore

__all__ = ["manifest", "newest", "upstream"]


def manifest(artifact: Path) -> dict:
    return json.loads((artifact / "manifest.json").read_text())


def upstream(store: ArtifactStore, preset: str, artifact: Path, stage: str) -> Path | None:
    """The artifact of ``stage`` that ``artifact`` (a stage of ``preset``) was built from, following
    its inputs up the preset's graph; ``artifact`` itself if it is of ``stage``; None if none is."""
    from flows.preset import load_preset

    plan = load_preset(preset)
    todo, seen = [artifact], set()
    while todo:
        here = todo.pop(0)
        if here in seen or not (here / "manifest.json").is_file():
            continue
        seen.add(here)
        m = manifest(here)
        if m["stage_id"] == stage:
            return here
        needs = plan.spec.stages[m["stage_id"]].needs if m["stage_id"] in plan.spec.stages else {}
        for name, source in m.get("inputs", {}).items():
            if name in needs:
                todo.append(store.path(needs[name], source["key"]))
    return None


def newest(store: ArtifactStore, stage: str, preset: str, need: str | None = None) -> Path | None:
    """The newest artifact of ``stage`` that belongs to ``preset`` (with input ``need``, if given)."""
    found = []
    for p in store.artifacts(stage):
        m = manifest(p)
        if need is not None and need not in m.get("inputs", {}):
            continue
        bundle = upstream(store, preset, p, "X")
        if bundle is not None and manifest(bundle)["config"].get("preset") == preset:
            found.append(p)
    return max(found, key=lambda p: (p / "manifest.json").stat().st_mtime) if found else None

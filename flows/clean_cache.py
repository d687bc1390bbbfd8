"""``make clean-cache``: delete published artifacts and leftovers of killed runs from the store,
listing each with its size first (``--dry-run`` only lists)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from core.store import ArtifactStore

__all__ = ["clean_cache"]


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def clean_cache(
    store: ArtifactStore, dry_run: bool, stage: str | None = None, older_than_days: float | None = None
) -> str:
    cutoff = time.time() - older_than_days * 86400 if older_than_days is not None else None
    targets = [p for p in store.artifacts(stage) if cutoff is None or p.stat().st_mtime < cutoff]
    targets += [p for p in store.leftovers(include_work=True) if stage is None or p.parent.name == stage]
    if not targets:
        return f"nothing to delete in {store.root}"
    verb = "would delete" if dry_run else "deleted"
    lines, total = [], 0
    for p in targets:
        size = _size(p)
        total += size
        lines.append(f"{verb} {p.relative_to(store.root)}  ({size / 1e6:.2f} MB)")
        if not dry_run:
            shutil.rmtree(p, ignore_errors=True)
    lines.append(f"{verb} {len(targets)} entries, {total / 1e6:.2f} MB in {store.root}")
    return "\n".join(lines)

"""Hashing shared by the plumbing and the stages: canonical JSON (cache keys, content digests) and
file sha256 (artifacts, raw sources, recipes, adapter manifests)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

__all__ = ["canonical_json", "file_sha256", "tree_sha256"]


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


_HASHED: dict[tuple, str] = {}


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    """sha256 of a file, remembered for this process while the file's size, mtime and inode stay
    the same (the CLI's preflight and the flow both digest the raw sources: big files are read once)."""
    st = os.stat(path)
    memo = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
    if memo in _HASHED:
        return _HASHED[memo]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    _HASHED[memo] = h.hexdigest()
    return _HASHED[memo]


def tree_sha256(root: Path) -> str:
    """sha256 over every file under ``root`` (its path relative to ``root`` and its sha256, in
    sorted order): a directory's digest for a cache key (a local dataset, a served checkpoint)."""
    h = hashlib.sha256()
    for p in sorted(Path(root).rglob("*")):
        if p.is_file():
            h.update(f"{p.relative_to(root)}:{file_sha256(p)}".encode())
    return h.hexdigest()

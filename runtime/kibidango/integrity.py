"""What the bundle and the pack share: sha256 of files, reading their JSON manifests, and the rule
that every path a manifest names stays inside its root (no absolute paths, no ``..``, no symlink
that leads out). Both :mod:`kibidango.bundle` and :mod:`kibidango.bundle.pack` import this module; it
imports neither."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path, PurePosixPath
from typing import Any

__all__ = ["BundleError", "contained", "parse_json", "read_json", "sha256_bytes", "sha256_file", "without_credentials"]


class BundleError(Exception):
    """A bundle that cannot be used as it is; the message names the file or tier at fault."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


_USERINFO = re.compile(r"(?<=://)[^\s/?#@]+(?=@)")


def without_credentials(text: str) -> str:
    """``text`` with every URL's credentials (``http://user:pass@host``) replaced by ``***``: a
    tracking URI or endpoint in an error message shows where, never who."""
    return _USERINFO.sub("***", text)


def read_json(path: Path, missing: str) -> Any:
    """A JSON file the runtime reads (bundle.json, pack.json, adapter.json): ``missing`` is the
    message when it is absent."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError as e:
        raise BundleError(missing) from e
    return parse_json(raw, path)


def parse_json(raw: bytes, path: Path) -> Any:
    """``raw`` (the bytes of ``path``) as JSON; invalid JSON, or JSON nested too deep to read,
    is an error naming the file."""
    try:
        return json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise BundleError(f"{path}: not valid JSON: {type(e).__name__}: {str(e)[:200]}") from e


def contained(root: Path, rel: Any, what: str) -> Path:
    """``root / rel`` for a relative POSIX path ``rel`` that a manifest names; refuses (naming
    ``what``, e.g. "pack.json files[3].path") a path that is not a non-empty string, is absolute,
    has a ``..`` part or a backslash, or that resolves (following symlinks) outside ``root``."""
    if not isinstance(rel, str) or not rel or rel in (".", "./"):
        raise BundleError(f"{what}: {rel!r} is not a file path")
    parts = PurePosixPath(rel).parts
    if rel.startswith("/") or "\\" in rel or "\x00" in rel or ".." in parts or (parts and ":" in parts[0]):
        raise BundleError(f"{what}: {rel!r} points outside the bundle (absolute, '..' or a drive): refused")
    path = root / rel
    base = root.resolve()
    if not path.resolve().is_relative_to(base):
        raise BundleError(f"{what}: {rel!r} resolves outside {root} (a symlink?): refused")
    return path

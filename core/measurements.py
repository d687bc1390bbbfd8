"""Measurement records: what a measuring command (``make eval-dedup``, ``make bench-runtime``, ...)
found, kept beside the command line, commit and time that produced it, so that ``make report``
prints every figure next to its command. One JSON file per measurement under
``<workspace>/reports/records/<name>.json``, or ``records/<preset>/<name>.json`` for a measurement
of one preset's bundle (the presets share a workspace); a new run of the same measurement replaces
it (a failed run leaves the last good record in place)."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

from core.paths import REPO_ROOT, home

__all__ = ["records_dir", "write_record", "read_records", "git_sha", "make_command", "shown_path"]

_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")


def records_dir() -> Path:
    return home() / "reports" / "records"


def shown_path(path: str | Path) -> str:
    """A path as a record shows it: relative to the workspace when inside it (``store/X/<key>``)."""
    try:
        return Path(path).resolve().relative_to(home()).as_posix()
    except ValueError:
        return str(path)


def make_command(target: str, args: list[str]) -> str:
    """How a record shows the make target that ran a script with ``args``: ``--preset P`` (which make
    passes) as ``PRESET=P`` where it is not the default tiny, the rest as ``ARGS=...``."""
    args, preset = list(args), "tiny"
    if "--preset" in args[:-1]:
        at = args.index("--preset")
        preset = args[at + 1]
        del args[at : at + 2]
    shown = f"make {target}" + (f" PRESET={shlex.quote(preset)}" if preset != "tiny" else "")
    return shown + (f" ARGS={shlex.quote(shlex.join(args))}" if args else "")


def git_sha() -> str:
    """The repository's commit, with ``-dirty`` when tracked files differ from it."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("-dirty" if dirty else "")


def write_record(
    name: str,
    title: str,
    command: str,
    *,
    output: str = "",
    markdown: str | None = None,
    data: dict[str, Any] | None = None,
    wall_s: float | None = None,
    preset: str | None = None,
) -> Path:
    """Write (atomically) the record ``name`` (of ``preset``'s bundle, if given): ``output`` is shown
    as printed text, ``markdown`` (when given) as written; ``data`` holds the figures for programs."""
    if not _NAME.match(name) or (preset is not None and not _NAME.match(preset)):
        raise ValueError(f"record name {name!r} / preset {preset!r}: use lowercase letters, digits and '-'")
    out = records_dir() / (f"{preset}/{name}.json" if preset else f"{name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "name": name,
        "title": title,
        "command": command,
        "git_sha": git_sha(),
        "finished": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "wall_s": wall_s,
        "output": output,
        "markdown": markdown,
        "data": data or {},
    }
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=2), encoding="utf-8")
    os.replace(tmp, out)
    return out


def read_records(preset: str | None = None) -> list[dict[str, Any]]:
    """Every record, by name: the workspace's, and ``preset``'s own in place of one of the same
    name; a file that is not a record is skipped."""
    found: dict[str, dict[str, Any]] = {}
    paths = sorted(records_dir().glob("*.json"))
    if preset is not None:
        paths += sorted((records_dir() / preset).glob("*.json"))
    for path in paths:
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and {"name", "title", "command"} <= record.keys():
            found[record["name"]] = {**record, "path": str(path)}
    return list(found.values())

"""Content-addressed artifact store.

Layout: ``<root>/<stage_id>/<cache_key>/`` holds a stage's files and a ``manifest.json``.
A stage writes into ``<root>/<stage_id>/.tmp-<key>-<pid>-<nonce>/`` and the store publishes it
with one ``os.rename``: a killed run leaves at most a ``.tmp-*`` directory, which no lookup ever
reads and the next run of the store sweeps away.

Verification policy. A lookup (a cache hit) checks every file's size and, against the
modification time recorded when it was published, re-hashes every file whose mtime changed, so an
edited file (same size or not) is a miss and the stage recomputes. ``verify(full=True)`` hashes
every file whatever its mtime: ``make verify`` runs it over the whole store, and the runner runs
it on the inputs of a stage that ships them (the bundle, stage X). An unreadable or malformed
``manifest.json`` is a miss, with a warning naming the directory; the recomputed artifact
replaces it. With a shared store (:mod:`core.remote`), a local miss looks there next, every
publication is pushed there, and a local hit the shared store lacks is pushed at its lookup.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from core.hashing import canonical_json, file_sha256
from core.processes import pid_alive

__all__ = [
    "Artifact",
    "ArtifactStore",
    "cache_key",
    "manifest_digest_problem",
    "read_manifest",
    "verify_files",
    "MANIFEST",
]

MANIFEST = "manifest.json"
MANIFEST_SCHEMA = 2
# Files under these folders are diagnostics (training logs with their tokens/s, wall times): listed,
# hashed and verified like every file, but not part of what the artifact *is*, so a forced rerun that
# repeats a stage's outputs byte for byte keeps the same digest and leaves every stage after it
# cached. Schema 1 manifests (stores written before) digest every file; they stay valid as written.
DIAGNOSTIC_DIRS = ("logs",)
_TMP_PREFIX = ".tmp-"
_WORK_PREFIX = ".work-"
_LOCK_PREFIX = ".lock-"
_TRASH_PREFIX = ".trash-"

log = logging.getLogger("kibidango.store")


def cache_key(stage_id: str, code_version: str, config: dict, input_digests: dict[str, str]) -> str:
    """sha256 over the stage id, its code version, its canonical config and its inputs' digests."""
    payload = canonical_json({"stage": stage_id, "code": code_version, "config": config, "inputs": input_digests})
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def content_digest(files: list[dict], schema: int = MANIFEST_SCHEMA) -> str:
    """Digest of an artifact's content: its files' paths and hashes (not the manifest, whose
    run id and timestamp differ between two runs that produce the same bytes), diagnostics
    (:data:`DIAGNOSTIC_DIRS`) left out from ``schema`` 2 on."""
    kept = [f for f in files if schema < 2 or Path(f["path"]).parts[0] not in DIAGNOSTIC_DIRS]
    return hashlib.sha256(canonical_json([[f["path"], f["sha256"]] for f in kept]).encode()).hexdigest()[:24]


def manifest_digest_problem(manifest: dict) -> str | None:
    """None when ``manifest``'s digest is the digest of its files under its own schema."""
    schema = manifest.get("schema", 1)
    if not isinstance(schema, int) or not 1 <= schema <= MANIFEST_SCHEMA:
        return f"manifest.json has schema {json.dumps(schema)[:20]}, this code reads 1 to {MANIFEST_SCHEMA}"
    if content_digest(manifest["files"], schema) != manifest["digest"]:
        return "manifest.json's digest is not the digest of its files"
    return None


@dataclass(frozen=True)
class Artifact:
    """A published artifact: what Prefect tasks pass to each other (paths and digests)."""

    stage_id: str
    key: str
    path: str
    digest: str

    @property
    def manifest(self) -> dict:
        return json.loads((Path(self.path) / MANIFEST).read_text())


class ArtifactStore:
    def __init__(self, root: Path | str, remote=None):
        """``remote``: a shared store (:class:`core.remote.RemoteStore`) where a lookup that misses
        here looks next, and where every publication is pushed."""
        self.root = Path(root).resolve()
        self.remote = remote

    def _stage_dir(self, stage_id: str) -> Path:
        return self.root / stage_id

    def path(self, stage_id: str, key: str) -> Path:
        return self._stage_dir(stage_id) / key

    def get(self, stage_id: str, key: str) -> Artifact | None:
        """The published artifact for ``key``, or None (a miss). A damaged artifact (a file
        missing, resized, or changed since it was published) or an unreadable manifest is a miss,
        with a warning naming the directory. With a shared store, a local miss is pulled from it
        and a local hit it lacks is pushed to it."""
        return self._reconcile(stage_id, key, newest=False)

    def sync(self, stage_id: str, key: str) -> Artifact | None:
        """:meth:`get`, and the shared store's version of ``key`` where it differs from the local
        copy (a stage recomputed elsewhere, e.g. forced on a worker, replaced it there)."""
        return self._reconcile(stage_id, key, newest=True)

    def _reconcile(self, stage_id: str, key: str, newest: bool) -> Artifact | None:
        local = self._local(stage_id, key)
        if self.remote is None:
            return local
        manifest = self.remote.manifest(stage_id, key)  # one read of the shared store per lookup
        if manifest is None:
            if local is not None:  # published here while the shared store was unreachable
                self.remote.push(Path(local.path), stage_id, key)
            return local
        if local is not None and (not newest or local.digest == manifest.get("digest")):
            return local
        return self._pull(stage_id, key, manifest)

    def _local(self, stage_id: str, key: str) -> Artifact | None:
        path = self.path(stage_id, key)
        if not (path / MANIFEST).exists():
            return None
        manifest, problem = read_manifest(path)
        if manifest is not None:
            problem = verify_files(path, manifest["files"], full=False)
        if not problem:
            problem = manifest_digest_problem(manifest)
        if problem:
            log.warning(
                f"{path}: {problem}; not used as a cache hit"
                + (", the stage recomputes" if self.remote is None else "")
            )
            return None
        return Artifact(stage_id, key, str(path), manifest["digest"])

    def _pull(self, stage_id: str, key: str, manifest: dict) -> Artifact | None:
        """The shared store's copy of ``key`` (its ``manifest`` read), checked and installed here
        (None: not intact, a miss)."""
        staging = self.new_staging_dir(stage_id, key)
        manifest = self.remote.pull(stage_id, key, staging, manifest)
        if manifest is None:
            self.discard(staging)
            return None
        artifact = self._install(stage_id, key, staging, manifest["digest"])
        log.info(f"stage {stage_id}: artifact {key} pulled from {self.remote.where(stage_id, key)}")
        return artifact

    def verify(self, artifact_dir: Path, full: bool = True) -> str | None:
        """None if the artifact at ``artifact_dir`` is intact (every file hashed with ``full``),
        else what is wrong with it."""
        manifest, problem = read_manifest(artifact_dir)
        return problem if manifest is None else verify_files(artifact_dir, manifest["files"], full)

    def new_staging_dir(self, stage_id: str, key: str) -> Path:
        """A fresh private directory to write a stage's output into."""
        self._sweep(stage_id)
        tmp = self._stage_dir(stage_id) / f"{_TMP_PREFIX}{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        return tmp

    @contextmanager
    def computing(self, stage_id: str, key: str, on_wait: Callable[[str], None] | None = None) -> Iterator[bool]:
        """Hold the right to compute ``key`` (an exclusive ``flock`` on ``.lock-<key>``, released
        when this process ends however it ends): two flows computing the same key at once would
        share its work directory. Yields whether it had to wait for another process (which may
        have published the artifact meanwhile)."""
        import fcntl

        path = self._stage_dir(stage_id) / f"{_LOCK_PREFIX}{key}"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a+") as f:
            waited = False
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.seek(0)
                if on_wait is not None:
                    on_wait(f.read().strip() or "another process")
                fcntl.flock(f, fcntl.LOCK_EX)
                waited = True
            f.seek(0)
            f.truncate()
            f.write(f"pid {os.getpid()} on {socket.gethostname()}")
            f.flush()
            try:
                yield waited
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def work_dir(self, stage_id: str, key: str) -> Path:
        """A directory that survives a failed or killed attempt of ``key`` (training
        checkpoints), so the next attempt can resume; the runner removes it once the artifact is
        published. Never read as an artifact."""
        path = self._stage_dir(stage_id) / f"{_WORK_PREFIX}{key}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def publish(self, stage_id: str, key: str, staging: Path, manifest_fields: dict) -> Artifact:
        """Hash every file in ``staging``, write the manifest, fsync, and rename it into place.
        A previously published artifact with the same key (a forced rerun) is replaced."""
        files = []
        for p in sorted(staging.rglob("*")):
            if p.is_file() and p.name != MANIFEST:
                st = p.stat()
                files.append(
                    {
                        "path": p.relative_to(staging).as_posix(),
                        "size": st.st_size,
                        "sha256": file_sha256(p),
                        "mtime_ns": st.st_mtime_ns,
                    }
                )
        digest = content_digest(files)
        manifest = {
            "schema": MANIFEST_SCHEMA,
            "stage_id": stage_id,
            "key": key,
            "digest": digest,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **manifest_fields,
            "files": files,
        }
        _write_durably(staging / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True))
        artifact = self._install(stage_id, key, staging, digest)
        if self.remote is not None:
            self.remote.push(Path(artifact.path), stage_id, key)
        return artifact

    def _install(self, stage_id: str, key: str, staging: Path, digest: str) -> Artifact:
        """Rename a complete staging directory (manifest written) into place."""
        final = self.path(stage_id, key)
        if final.exists():
            # Forced rerun: move the old one aside first (rename cannot replace a non-empty
            # directory). A concurrent reader sees the key missing for an instant and recomputes.
            final.rename(self._stage_dir(stage_id) / f"{_TRASH_PREFIX}{key}-{uuid.uuid4().hex[:8]}")
        os.rename(staging, final)
        _fsync_dir(final.parent)
        self._sweep(stage_id)
        return Artifact(stage_id, key, str(final), digest)

    def discard(self, staging: Path) -> None:
        shutil.rmtree(staging, ignore_errors=True)

    def artifacts(self, stage_id: str | None = None) -> Iterator[Path]:
        """Published artifact directories (optionally of one stage)."""
        stages = [self._stage_dir(stage_id)] if stage_id else sorted(self.root.glob("*"))
        for stage_dir in stages:
            if stage_dir.is_dir():
                for p in sorted(stage_dir.iterdir()):
                    if p.is_dir() and not p.name.startswith("."):
                        yield p

    def leftovers(self, include_work: bool = False) -> Iterator[Path]:
        """Staging directories of dead processes and replaced artifacts (and, with
        ``include_work``, checkpoints kept for resuming interrupted training)."""
        for stage_dir in sorted(self.root.glob("*")):
            for p in sorted(stage_dir.glob(".*")):
                if p.name.startswith(_TRASH_PREFIX) or (p.name.startswith(_TMP_PREFIX) and not _owner_alive(p)):
                    yield p
                elif include_work and p.name.startswith(_WORK_PREFIX):
                    yield p

    def _sweep(self, stage_id: str) -> None:
        for p in self.leftovers():
            if p.parent.name == stage_id:
                shutil.rmtree(p, ignore_errors=True)


def read_manifest(path: Path) -> tuple[dict | None, str | None]:
    """An artifact's manifest, or (None, why it cannot be used)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, "no manifest.json"
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        return None, f"manifest.json is unreadable ({type(e).__name__})"
    if (
        not isinstance(manifest, dict)
        or not isinstance(manifest.get("digest"), str)
        or not isinstance(manifest.get("files"), list)
    ):
        return None, "manifest.json lacks its digest or file list"
    paths: set[str] = set()
    for i, f in enumerate(manifest["files"]):
        if not (
            isinstance(f, dict)
            and isinstance(f.get("path"), str)
            and isinstance(f.get("size"), int)
            and isinstance(f.get("sha256"), str)
        ):
            return None, f"manifest.json files[{i}] is malformed"
        parts = Path(f["path"]).parts
        if Path(f["path"]).is_absolute() or ".." in parts or not parts or f["path"] != Path(f["path"]).as_posix():
            return None, f"manifest.json files[{i}] points outside the artifact"
        paths.add(Path(f["path"]).as_posix())
    if len(paths) < len(manifest["files"]):
        return None, "manifest.json lists a file twice"
    for path in sorted(paths):  # `a` and `a/b`: one name cannot be a file and a directory
        clash = sorted({p.as_posix() for p in Path(path).parents} & paths)
        if clash:
            return None, f"manifest.json lists {clash[0]!r} as a file and {path!r} inside it"
    return manifest, None


def verify_files(root: Path, files: list[dict], full: bool) -> str | None:
    """None if every listed file is present with its size and sha256 (hashed when ``full`` or
    when its mtime differs from the one recorded at publish time), else the first problem."""
    for f in files:
        p = root / f["path"]
        try:
            st = p.stat()
        except OSError:
            return f"{f['path']} is missing"
        if st.st_size != f["size"]:
            return f"{f['path']} has {st.st_size} bytes, the manifest says {f['size']}"
        if (full or st.st_mtime_ns != f.get("mtime_ns")) and file_sha256(p) != f["sha256"]:
            return f"{f['path']} does not match its sha256 (changed since it was published)"
    return None


def _owner_alive(tmp: Path) -> bool:
    """True if the process that created staging dir ``tmp`` is still running."""
    try:
        pid = int(tmp.name[len(_TMP_PREFIX) :].split("-")[1])
    except (IndexError, ValueError):
        return False
    return pid_alive(pid)


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

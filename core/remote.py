"""A shared artifact store: the local store's artifacts mirrored to an object store (any fsspec URL:
``s3://bucket/prefix`` through s3fs, ``gs://``, ``file://`` ...), so that several machines of one
run find each other's artifacts.

Layout: ``<url>/<stage_id>/<cache_key>/`` with the artifact's files and its ``manifest.json``. An
object store has no rename, so publication keeps the local store's guarantee another way: the
manifest is the commit marker. A push removes the old manifest first (readers then see a miss),
uploads every file, and writes the manifest last (one PUT, atomic on S3); a pull reads the
manifest, downloads every file it lists and checks each one's size and sha256 before the artifact
enters the local store (with the local store's own atomic rename). A half-pushed, damaged or
replaced-meanwhile artifact is a miss with a warning, never a wrong input.

The local store stays the working copy (stages read and write local paths); the remote is where
lookups that miss locally look next and where every publication goes. Credentials come from the
object store's usual environment (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ...), never from
a config file of ours, and are not logged.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from core.contract import KibidangoError
from core.hashing import file_sha256

__all__ = ["RemoteStore"]

MANIFEST = "manifest.json"

log = logging.getLogger("kibidango.store")


class RemoteStore:
    def __init__(self, url: str, storage_options: dict | None = None):
        import fsspec

        try:
            self.fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        except (ImportError, ValueError) as e:
            raise KibidangoError(f"artifact store URL {url!r}: {e}") from None
        self.url = url
        self.root = root.rstrip("/")

    @classmethod
    def from_env(cls) -> RemoteStore | None:
        """``KIBIDANGO_STORE_URL`` (None: no shared store) with fsspec options from
        ``KIBIDANGO_STORE_OPTIONS`` (JSON, e.g. ``{"endpoint_url": "http://127.0.0.1:9000"}``)."""
        url = os.environ.get("KIBIDANGO_STORE_URL")
        if not url:
            return None
        raw = os.environ.get("KIBIDANGO_STORE_OPTIONS") or "{}"
        try:
            options = json.loads(raw)
        except ValueError as e:
            raise KibidangoError(f"KIBIDANGO_STORE_OPTIONS is not JSON ({e})") from None
        if not isinstance(options, dict):
            raise KibidangoError("KIBIDANGO_STORE_OPTIONS must be a JSON object")
        return cls(url, options)

    def _dir(self, stage_id: str, key: str) -> str:
        return f"{self.root}/{stage_id}/{key}"

    def where(self, stage_id: str, key: str) -> str:
        protocol = self.fs.protocol[0] if isinstance(self.fs.protocol, tuple) else self.fs.protocol
        return f"{protocol}://{self._dir(stage_id, key)}"

    def manifest(self, stage_id: str, key: str) -> dict | None:
        """The published manifest of ``key`` (None: not published, or unreadable, with a warning)."""
        path = f"{self._dir(stage_id, key)}/{MANIFEST}"
        self.fs.invalidate_cache()  # another machine may have published since this process listed anything
        try:
            raw = self.fs.cat_file(path)
        except FileNotFoundError:
            return None
        try:
            manifest = json.loads(raw)
        except ValueError:
            log.warning(f"{self.where(stage_id, key)}: manifest.json is unreadable; not used, the stage recomputes")
            return None
        return manifest

    def push(self, artifact_dir: Path, stage_id: str, key: str) -> None:
        """Upload a published local artifact; its manifest last."""
        manifest = json.loads((artifact_dir / MANIFEST).read_text())
        remote = self._dir(stage_id, key)
        self.fs.invalidate_cache()
        if self.fs.exists(f"{remote}/{MANIFEST}"):  # a forced rerun: unpublish first
            self.fs.rm_file(f"{remote}/{MANIFEST}")
        for f in manifest["files"]:
            self.fs.put_file(str(artifact_dir / f["path"]), f"{remote}/{f['path']}")
        self.fs.put_file(str(artifact_dir / MANIFEST), f"{remote}/{MANIFEST}")
        log.info(f"stage {stage_id}: artifact {key} pushed to {self.where(stage_id, key)}")

    def pull(self, stage_id: str, key: str, staging: Path, manifest: dict | None = None) -> dict | None:
        """Download ``key`` into ``staging`` and check every file; the manifest (with this
        machine's file times) or None when it is not there or not intact. ``manifest``: the one
        :meth:`manifest` returned, when the caller has read it already."""
        manifest = manifest if manifest is not None else self.manifest(stage_id, key)
        if manifest is None:
            return None
        from core.store import read_manifest  # the same checks as a local manifest

        (staging / MANIFEST).write_text(json.dumps(manifest))
        manifest, problem = read_manifest(staging)
        remote = self._dir(stage_id, key)
        for f in [] if manifest is None else manifest["files"]:
            dest = staging / f["path"]
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                self.fs.get_file(f"{remote}/{f['path']}", str(dest))
            except FileNotFoundError:
                problem = f"{f['path']} is missing"
                break
            if dest.stat().st_size != f["size"] or file_sha256(dest) != f["sha256"]:
                problem = f"{f['path']} does not match its size and sha256"
                break
            f["mtime_ns"] = dest.stat().st_mtime_ns
        if problem:
            log.warning(f"{self.where(stage_id, key)}: {problem}; not used as a cache hit, the stage recomputes")
            return None
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
        return manifest

"""A shared artifact store: the local store's artifacts mirrored to an object store (any fsspec URL:
``s3://bucket/prefix`` through s3fs, ``gs://``, ``file://`` ...), so that several machines of one
run find each other's artifacts.

Layout: ``<url>/<stage_id>/<cache_key>/manifest.json``, and the artifact's files under a prefix
of their own publication, ``<url>/<stage_id>/<cache_key>/<publication>/``, which the manifest
names (``"prefix"``). An object store has no rename, so publication keeps the local store's
guarantee another way: a push uploads every file under a new, unique prefix, then writes the
manifest (one PUT, atomic on S3) — the switch. Two machines publishing one key at once each write
their own prefix, and the manifest names whichever finished last: complete either way, never a
mix (the losing prefix is left, and removed by a later push once it is an hour old). A pull reads
the manifest, downloads every file it lists and checks each one's size and sha256 before the
artifact enters the local store (with the local store's own atomic rename); the artifact's
digest is computed again from the checked files, never taken from the manifest. A half-pushed,
damaged, forged or malformed artifact is a miss with a warning, never a wrong input or a crash.
(Manifests of the first layout, files beside the manifest, are still read.)

The local store stays the working copy (stages read and write local paths); the remote is where
lookups that miss locally look next and where every publication goes. Credentials come from the
object store's usual environment (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ...), never from
a config file of ours, and are not logged.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
from pathlib import Path

from core.contract import KibidangoError
from core.hashing import file_sha256

__all__ = ["RemoteStore"]

MANIFEST = "manifest.json"
_PUBLICATION = "pub-"
_PREFIX_NAME = re.compile(r"^pub-[0-9]{1,12}-[0-9a-f]{12}$")

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
        """Upload a published local artifact under a prefix of its own; then switch the manifest
        to it. What was published before stays readable until the switch."""
        manifest = json.loads((artifact_dir / MANIFEST).read_text())
        remote = self._dir(stage_id, key)
        prefix = f"{_PUBLICATION}{int(time.time())}-{uuid.uuid4().hex[:12]}"
        for f in manifest["files"]:
            self.fs.put_file(str(artifact_dir / f["path"]), f"{remote}/{prefix}/{f['path']}")
        manifest["prefix"] = prefix
        self.fs.pipe_file(f"{remote}/{MANIFEST}", json.dumps(manifest, indent=2, sort_keys=True).encode())
        log.info(f"stage {stage_id}: artifact {key} pushed to {self.where(stage_id, key)}")
        self._collect(remote, keep=prefix)

    def _collect(self, remote: str, keep: str) -> None:
        """Remove publications of this key an hour old or more that the manifest does not name
        (replaced by a forced rerun, or lost a race): never one a reader or publisher may be using."""
        self.fs.invalidate_cache()
        try:
            named = json.loads(self.fs.cat_file(f"{remote}/{MANIFEST}")).get("prefix")
            entries = self.fs.ls(remote, detail=False)
        except (OSError, ValueError):
            return
        for entry in entries:
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if not name.startswith(_PUBLICATION) or name in (keep, named):
                continue
            try:
                made = int(name[len(_PUBLICATION) :].split("-", 1)[0])
            except ValueError:
                continue
            if time.time() - made > 3600:
                self.fs.rm(entry, recursive=True)

    def pull(self, stage_id: str, key: str, staging: Path, manifest: dict | None = None) -> dict | None:
        """Download ``key`` into ``staging`` and check every file; the manifest (with this
        machine's file times) or None when it is not there or not intact. ``manifest``: the one
        :meth:`manifest` returned, when the caller has read it already."""
        manifest = manifest if manifest is not None else self.manifest(stage_id, key)
        if manifest is None:
            return None
        from core.store import manifest_digest_problem, read_manifest  # the same checks as a local one

        (staging / MANIFEST).write_text(json.dumps(manifest))
        manifest, problem = read_manifest(staging)
        remote = self._dir(stage_id, key)
        prefix = manifest.get("prefix") if manifest is not None else None
        if prefix is not None and not (isinstance(prefix, str) and _PREFIX_NAME.match(prefix)):
            manifest, problem = None, f"manifest.json names a malformed prefix {str(prefix)[:60]!r}"
        source = f"{remote}/{prefix}" if prefix else remote
        for f in [] if manifest is None else manifest["files"]:
            dest = staging / f["path"]
            try:
                dest.parent.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(f"{source}/{f['path']}", str(dest))
            except FileNotFoundError:
                problem = f"{f['path']} is missing"
                break
            except OSError as e:  # a path the manifest lists both as a file and as a directory, say
                problem = f"{f['path']} cannot be written ({type(e).__name__})"
                break
            if dest.stat().st_size != f["size"] or file_sha256(dest) != f["sha256"]:
                problem = f"{f['path']} does not match its size and sha256"
                break
            f["mtime_ns"] = dest.stat().st_mtime_ns
        if manifest is not None and not problem:
            problem = manifest_digest_problem(manifest)
        if problem:
            log.warning(f"{self.where(stage_id, key)}: {problem}; not used as a cache hit, the stage recomputes")
            return None
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
        return manifest

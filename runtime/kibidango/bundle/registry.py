"""Bundles from the MLflow Model Registry: ``models:/<name>@<alias>`` or ``models:/<name>/<version>``
wherever a bundle directory goes (``--bundle``, :meth:`kibidango.Pipeline.from_bundle`).

The pipeline's stage 9A registers every bundle it judges as a version of ``kibidango-<preset>``:
the bundle's files are the version's MLflow artifacts and the tag ``kibidango.bundle_sha256`` is
bundle.json's sha256; the alias ``champion`` only ever points at a releasable version.
:func:`fetch` resolves the name, downloads the version through MLflow's own artifact download
(``MLFLOW_TRACKING_URI`` says which tracking server or database) into
``$KIBIDANGO_CACHE/registry/<name>/<version>`` (kept while its bundle.json still has the registered
digest) and refuses a download whose bundle.json is not the registered one;
:func:`kibidango.bundle.load_bundle` then checks every file against bundle.json, as for any bundle.

Needs ``mlflow`` (``pip install 'kibidango[registry]'``, the client-only ``mlflow-skinny``).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from kibidango.integrity import BundleError, sha256_file, without_credentials

__all__ = ["DIGEST_TAG", "PREFIX", "fetch", "is_registry_uri", "parse"]

PREFIX = "models:/"
DIGEST_TAG = "kibidango.bundle_sha256"
_NAME = re.compile(r"^models:/([^/@]+)(?:@([A-Za-z0-9_-]+)|/([0-9]+))$")


def is_registry_uri(path: object) -> bool:
    return isinstance(path, str) and path.startswith(PREFIX)


def parse(uri: str) -> tuple[str, str | None, int | None]:
    """``models:/name@alias`` -> (name, alias, None); ``models:/name/3`` -> (name, None, 3)."""
    m = _NAME.match(uri)
    if not m:
        raise BundleError(f"{uri}: not a registered bundle; write models:/<name>@<alias> or models:/<name>/<version>")
    return m.group(1), m.group(2), int(m.group(3)) if m.group(3) else None


def _cache_root() -> Path:
    return Path(os.environ.get("KIBIDANGO_CACHE", Path.home() / ".cache" / "kibidango")) / "registry"


def fetch(uri: str) -> Path:
    """The registered bundle ``uri`` as a local directory whose bundle.json has the registered
    digest (downloaded once per version)."""
    name, alias, version = parse(uri)
    try:
        from mlflow.artifacts import download_artifacts
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise BundleError(
            f"{uri}: a bundle from the MLflow Model Registry needs mlflow: pip install 'kibidango[registry]'"
        ) from None
    try:
        client = MlflowClient()
        mv = client.get_model_version_by_alias(name, alias) if alias else client.get_model_version(name, str(version))
    except MlflowException as e:
        raise BundleError(without_credentials(f"{uri}: {e.message} (tracking URI {client.tracking_uri})")) from None
    except Exception as e:  # the tracking store could not be reached at all (a database driver missing, ...)
        where = without_credentials(os.environ.get("MLFLOW_TRACKING_URI", "the default tracking URI"))
        raise BundleError(without_credentials(f"{uri}: {where}: {type(e).__name__}: {str(e)[:300]}")) from None
    digest = (mv.tags or {}).get(DIGEST_TAG)
    if not digest:
        raise BundleError(f"{uri}: version {mv.version} has no {DIGEST_TAG} tag: not a kibidango bundle")
    dest = _cache_root() / name / str(mv.version)
    if (dest / "bundle.json").is_file() and sha256_file(dest / "bundle.json") == digest:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{mv.version}-") as tmp:
        got = Path(download_artifacts(artifact_uri=f"{PREFIX}{name}/{mv.version}", dst_path=tmp))
        if not (got / "bundle.json").is_file():
            raise BundleError(f"{uri}: version {mv.version}'s artifacts have no bundle.json")
        found = sha256_file(got / "bundle.json")
        if found != digest:
            raise BundleError(
                f"{uri}: the downloaded bundle.json has sha256 {found}, version {mv.version} was registered with "
                f"{digest}: refused"
            )
        shutil.rmtree(dest, ignore_errors=True)
        got.rename(dest)
    return dest

"""Where things are: the repository (recipes and presets are named relative to it) and the workspace."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["REPO_ROOT", "home", "tracking_uri"]

REPO_ROOT = Path(__file__).resolve().parent.parent


def home() -> Path:
    """The workspace: ``$KIBIDANGO_HOME`` (default ``./.kibidango``): the artifact store, MLflow's
    database and artifacts, fetched tools."""
    return Path(os.environ.get("KIBIDANGO_HOME", ".kibidango")).resolve()


def tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI`` if set (a server with Postgres/S3 works unchanged), else a sqlite
    file in the workspace. (MLflow's plain file store is deprecated and now errors.)"""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{home() / 'mlflow.db'}"

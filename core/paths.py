"""Where things are: the repository (recipes and presets are named relative to it) and the workspace."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["REPO_ROOT", "home"]

REPO_ROOT = Path(__file__).resolve().parent.parent


def home() -> Path:
    """The workspace: ``$KIBIDANGO_HOME`` (default ``./.kibidango``): the artifact store, MLflow's
    database and artifacts, fetched tools."""
    return Path(os.environ.get("KIBIDANGO_HOME", ".kibidango")).resolve()

"""Where the repository is: recipes and presets are named relative to it."""

from __future__ import annotations

from pathlib import Path

__all__ = ["REPO_ROOT"]

REPO_ROOT = Path(__file__).resolve().parent.parent

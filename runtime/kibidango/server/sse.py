"""Server-sent events as OpenAI's streaming endpoints frame them: one ``data:`` line of JSON per
event, a blank line after it, and ``data: [DONE]`` to end the stream."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["DONE", "event"]

DONE = "data: [DONE]\n\n"


def event(obj: dict[str, Any]) -> str:
    """One event carrying ``obj``."""
    return f"data: {json.dumps(obj)}\n\n"

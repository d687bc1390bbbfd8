"""An append-only, fsynced JSONL journal: what a resumable stage has finished (or sent), read back
by the next attempt of the same cache key.

Every :meth:`Journal.write` is flushed and fsynced before it returns, so a kill loses at most the
line being written; that torn line is skipped (with a warning) when the journal is read again.
Thread-safe: stages with concurrent requests (1D) write from several threads.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

__all__ = ["Journal"]

log = logging.getLogger("kibidango.journal")


class Journal:
    """Events of a run (``work_dir/<name>.jsonl``): ``events`` holds those of earlier attempts
    (``resumed`` of them) followed by this attempt's."""

    def __init__(self, path: Path):
        self.path = path
        self.events: list[dict] = []
        if path.is_file():
            torn = 0
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    self.events.append(json.loads(line))
                except json.JSONDecodeError:
                    torn += 1  # the line being written when the last attempt was killed
            if torn:
                log.warning(f"{path}: {torn} incomplete line(s) from an interrupted attempt ignored")
        self.resumed = len(self.events)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - held open for appends
        self._lock = threading.Lock()

    def write(self, event: dict) -> None:
        """Append ``event`` durably: once this returns, a kill does not lose it."""
        with self._lock:
            self._file.write(json.dumps(event, ensure_ascii=False) + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())
            self.events.append(event)

    def close(self) -> None:
        self._file.close()

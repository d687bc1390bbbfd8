"""An append-only, fsynced JSONL journal: what a resumable stage has finished (or sent), read back
by the next attempt of the same cache key.

Every :meth:`Journal.write` is one ``write`` of a whole line, flushed and fsynced before it
returns, under a lock: a kill loses at most the line being written, and that torn line can only be
the last one. So on reading:

- a damaged line that is **not** the last is refused (:class:`JournalDamaged`, naming the file and
  the line): the journal was changed after it was written, and nothing it says can be trusted to
  prove a request was never sent;
- the last line, when damaged, is a torn write. It stays in :attr:`Journal.events` as
  ``{"event": "torn", "line": N, "text": <the fragment>}`` in its place, for the stage to decide
  what it may have recorded (1D: a request perhaps sent and paid). The next write first appends an
  acknowledgement, ``{"event": "torn", "line": N}``, to the fragment's own line (or on the next
  line when the fragment ends in a newline), so a later attempt reads the same fragment in the same
  place; an acknowledgement cut by another kill leaves the line damaged and last, as before.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

from core.contract import KibidangoError

__all__ = ["Journal", "JournalDamaged"]

log = logging.getLogger("kibidango.journal")


class JournalDamaged(KibidangoError):
    """A journal line that is not a torn last write cannot be read."""


class Journal:
    """Events of a run (``work_dir/<name>.jsonl``): ``events`` holds those of earlier attempts
    (``resumed`` of them, torn fragments included as ``torn`` events) followed by this attempt's."""

    def __init__(self, path: Path):
        self.path = path
        self.events: list[dict] = []
        self.torn: list[dict] = []
        self._pending: dict | None = None  # a trailing torn line not yet acknowledged
        lines = path.read_bytes().decode("utf-8", "replace").split("\n") if path.is_file() else []
        ends_cleanly = not lines or lines[-1] == ""
        if ends_cleanly and lines:
            lines.pop()
        acked = {e.get("line") for e in map(_parse, lines) if e is not None and e.get("event") == "torn"}
        for n, line in enumerate(lines, 1):
            event = _parse(line)
            if event is not None and event.get("event") == "torn":
                continue  # an acknowledgement on a line of its own: its fragment is already in place
            if event is None:
                last = n == len(lines)
                suffix = _ack(n)
                if line.endswith(suffix):  # a fragment acknowledged on its own line
                    line, acknowledged = line[: -len(suffix)], True
                else:
                    acknowledged = n in acked
                if not last and not acknowledged:
                    raise JournalDamaged(
                        f"{path}: line {n} is damaged ({line[:80]!r}) and is not the last line, so it is not a write "
                        "cut by a kill: the journal was changed after it was written. Restore it from a backup; "
                        "nothing in it can prove which requests were sent (deleting it would pay for them again)"
                    )
                event = {"event": "torn", "line": n, "text": line[:2000]}
                self.torn.append(event)
                if last and not acknowledged:
                    self._pending = {"line": n}
            self.events.append(event)
        if self._pending is not None:
            log.warning(f"{path}: line {self._pending['line']} was cut by a kill of an earlier attempt")
        self.resumed = len(self.events)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - held open for appends
        self._lock = threading.Lock()

    def write(self, event: dict) -> None:
        """Append ``event`` durably: once this returns, a kill does not lose it."""
        with self._lock:
            data = json.dumps(event, ensure_ascii=False) + "\n"
            if self._pending is not None:  # say the torn line was seen, on that line, with this event
                data = _ack(self._pending["line"]) + "\n" + data  # on the fragment's line, or after its newline
                self._pending = None
            self._file.write(data)
            self._file.flush()
            os.fsync(self._file.fileno())
            self.events.append(event)

    def close(self) -> None:
        self._file.close()


def _ack(line: int) -> str:
    return json.dumps({"event": "torn", "line": line})


def _parse(line: str) -> dict | None:
    try:
        event = json.loads(line)
    except (json.JSONDecodeError, RecursionError):
        return None
    return event if isinstance(event, dict) and isinstance(event.get("event", ""), str) else None

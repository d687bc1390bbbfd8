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
from collections.abc import Callable
from pathlib import Path

from core.contract import KibidangoError

__all__ = ["Journal", "JournalDamaged"]

log = logging.getLogger("kibidango.journal")


class JournalDamaged(KibidangoError):
    """A journal line that is not a torn last write cannot be read."""


class Journal:
    """Events of a run (``work_dir/<name>.jsonl``): ``events`` holds those of earlier attempts
    (``resumed`` of them, torn fragments included as ``torn`` events) followed by this attempt's.
    ``check(event)``: why a parsed event cannot be what this journal's writer wrote (a field
    missing or of the wrong type), or None; such a line is damaged like one that is not JSON."""

    def __init__(self, path: Path, check: Callable[[dict], str | None] | None = None):
        self.path = path
        self.events: list[dict] = []
        self.torn: list[dict] = []
        self._pending: dict | None = None  # a trailing torn line not yet acknowledged
        raw = path.read_bytes().split(b"\n") if path.is_file() else []
        if raw and raw[-1] == b"":
            raw.pop()
        texts = [_decode(line) for line in raw]
        events = [_parse(t, check) for t in texts]
        for n, (text, event) in enumerate(zip(texts, events), 1):
            if event is not None and event.get("event") == "torn":
                # an acknowledgement on a line of its own: only right after the cut line it names
                if event.get("line") == n - 1 and n >= 2 and events[n - 2] is None:
                    continue
                raise JournalDamaged(
                    f"{path}: line {n} marks line {event.get('line')!r} as cut by a kill, but it does not follow "
                    "that line: this journal's writer never wrote it. " + _RESTORE
                )
            if event is None:
                fragment = text if text is not None else raw[n - 1].decode("utf-8", "replace")
                last = n == len(raw)
                suffix = _ack(n)
                if text is not None and text.endswith(suffix):  # a fragment acknowledged on its own line
                    fragment, acknowledged = text[: -len(suffix)], True
                else:
                    acknowledged = n < len(raw) and texts[n] == _ack(n)
                if not last and not acknowledged:
                    why = "is not UTF-8" if text is None else "is damaged"
                    raise JournalDamaged(
                        f"{path}: line {n} {why} ({fragment[:80]!r}) and is not the last line, so it is not a write "
                        "cut by a kill: the journal was changed after it was written. " + _RESTORE
                    )
                event = {"event": "torn", "line": n, "text": fragment[:2000]}
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


_RESTORE = (
    "Restore it from a backup; nothing in it can prove which requests were sent (deleting it would pay for them again)"
)


def _decode(line: bytes) -> str | None:
    """A line as written (the writer writes UTF-8), or None: bytes that are not UTF-8 were not
    written by it, and replacing them would read a changed request id as another one."""
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _parse(line: str | None, check: Callable[[dict], str | None] | None = None) -> dict | None:
    if line is None:
        return None
    try:
        event = json.loads(line)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(event, dict) or not isinstance(event.get("event", ""), str):
        return None
    if event.get("event") == "torn":  # an acknowledgement: a line number and nothing else
        return event if set(event) == {"event", "line"} and type(event["line"]) is int else None
    return event if check is None or check(event) is None else None

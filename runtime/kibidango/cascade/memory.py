"""Session memory (the plan's 6D): the last exchanges of a conversation, kept per session id in
SQLite (WAL, ``<state dir>/memory.sqlite``), shared by threads and processes, surviving restarts.

Bounded three ways: at most ``turns`` exchanges per session (older ones are deleted as new ones
arrive), at most ``max_chars`` of context handed back (the oldest exchanges are dropped first,
and one exchange longer than that is cut from its start), and a retention limit: exchanges older
than ``retention_s`` are deleted (:meth:`SessionMemory.purge`, also run as exchanges are added).

Every method takes a ``scope``: whose sessions these are (the server passes a digest of the
request's API key). The same session id under another scope is another session: a client never
reads, extends or forgets a session another key created.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

from kibidango.paid.state import Database

__all__ = ["SessionMemory"]

_SESSION = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


class SessionMemory:
    def __init__(
        self,
        state_dir: str | Path,
        turns: int = 5,
        max_chars: int = 8000,
        retention_s: float = 7 * 86400,
        clock: Callable[[], float] = time.time,
    ):
        if turns < 1 or max_chars < 1 or retention_s <= 0:
            raise ValueError("session memory: turns, max_chars and retention_s are positive")
        self._db = Database(Path(state_dir) / "memory.sqlite")
        self.path = self._db.path
        self.turns, self.max_chars, self.retention_s = turns, max_chars, retention_s
        self._clock = clock
        db = self._db.connection()
        db.execute(
            "CREATE TABLE IF NOT EXISTS exchanges (session TEXT NOT NULL, at REAL NOT NULL,"
            " user TEXT NOT NULL, assistant TEXT NOT NULL, scope TEXT NOT NULL DEFAULT '')"
        )
        if "scope" not in {row[1] for row in db.execute("PRAGMA table_info(exchanges)")}:  # an older state dir
            db.execute("ALTER TABLE exchanges ADD COLUMN scope TEXT NOT NULL DEFAULT ''")
        db.execute("CREATE INDEX IF NOT EXISTS exchanges_scope_session ON exchanges (scope, session, at)")

    @staticmethod
    def check_id(session: str) -> str:
        if not isinstance(session, str) or not _SESSION.match(session):
            raise ValueError("session id: 1-128 characters of A-Z, a-z, 0-9, _ . : -")
        return session

    def add(self, session: str, user: str, assistant: str, scope: str = "") -> None:
        """Keep one exchange; drop the session's exchanges beyond ``turns`` and every expired one."""
        self.check_id(session)
        now = self._clock()
        with self._db.transaction() as db:
            db.execute(
                "INSERT INTO exchanges (session, at, user, assistant, scope) VALUES (?, ?, ?, ?, ?)",
                (session, now, user, assistant, scope),
            )
            db.execute(
                "DELETE FROM exchanges WHERE scope = ? AND session = ? AND rowid NOT IN (SELECT rowid FROM exchanges"
                " WHERE scope = ? AND session = ? ORDER BY at DESC, rowid DESC LIMIT ?)",
                (scope, session, scope, session, self.turns),
            )
            db.execute("DELETE FROM exchanges WHERE at < ?", (now - self.retention_s,))

    def context(self, session: str, scope: str = "") -> list[dict[str, str]]:
        """The session's kept exchanges as chat turns, oldest first, within ``max_chars``."""
        self.check_id(session)
        rows = (
            self._db.connection()
            .execute(
                "SELECT user, assistant FROM exchanges WHERE scope = ? AND session = ? AND at >= ?"
                " ORDER BY at DESC, rowid DESC LIMIT ?",
                (scope, session, self._clock() - self.retention_s, self.turns),
            )
            .fetchall()
        )
        kept, size = [], 0
        for user, assistant in rows:  # newest first: the oldest go when the bound is reached
            if size + len(user) + len(assistant) > self.max_chars:
                if not kept:  # one exchange longer than the bound: its end, which the next turn follows
                    room = self.max_chars
                    assistant = assistant[-room:]
                    user = user[-max(0, room - len(assistant)) :] if room > len(assistant) else ""
                    kept.append((user, assistant))
                break
            kept.append((user, assistant))
            size += len(user) + len(assistant)
        turns: list[dict[str, str]] = []
        for user, assistant in reversed(kept):
            turns += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        return turns

    def purge(self) -> int:
        """Delete every expired exchange; returns how many."""
        cur = self._db.connection().execute("DELETE FROM exchanges WHERE at < ?", (self._clock() - self.retention_s,))
        return cur.rowcount

    def forget(self, session: str, scope: str = "") -> int:
        """Delete the session's exchanges (in ``scope``); returns how many there were."""
        cur = self._db.connection().execute(
            "DELETE FROM exchanges WHERE scope = ? AND session = ?", (scope, self.check_id(session))
        )
        return cur.rowcount

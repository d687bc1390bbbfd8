"""The runtime's state directory, shared by threads and processes: SQLite databases in WAL mode
(the budget ledger, session memory) and whether a process that left a record still runs.

:class:`Database` gives each thread its own connection (sqlite3 connections are not shared across
threads) and :meth:`Database.transaction` a ``BEGIN IMMEDIATE`` transaction: one writer at a time
across every process, the others waiting up to the busy timeout.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["Database", "default_state_dir", "pid_alive", "process_token"]


def default_state_dir() -> Path:
    """``$KIBIDANGO_STATE``, else ``$XDG_STATE_HOME/kibidango``, else ``~/.local/state/kibidango``."""
    if os.environ.get("KIBIDANGO_STATE"):
        return Path(os.environ["KIBIDANGO_STATE"]).expanduser()
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base).expanduser() / "kibidango"


def process_token(pid: int | None = None) -> str | None:
    """What tells one process from a later one with the same id: the boot id and the process's
    start time (Linux ``/proc``); None where neither can be read."""
    pid = os.getpid() if pid is None else pid
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # after the command name, which may hold spaces
    return f"{boot}:{fields[19]}" if len(fields) > 19 else None


def pid_alive(pid: int, token: str | None = None) -> bool:
    """True if the process with this id runs on this machine (ours included) — and, given the
    ``token`` it recorded (:func:`process_token`), is that process and not a later one that got
    the same id (a server restarted after ``kill -9`` as PID 1 of its container)."""
    if token is not None:
        now = process_token(pid)
        if now is not None:
            return now == token
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


class Database:
    """``Database(path, synchronous="FULL")``: a per-thread connection to ``path`` in WAL mode."""

    def __init__(self, path: str | Path, synchronous: str | None = None, busy_timeout_s: float = 30.0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.synchronous = synchronous
        self.busy_timeout_s = busy_timeout_s
        self._local = threading.local()

    def connection(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None)
            _wal(db)
            if self.synchronous:
                db.execute(f"PRAGMA synchronous={self.synchronous}")
            self._local.db = db
        return db

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        db = self.connection()
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")


def _wal(db: sqlite3.Connection) -> None:
    """Switch to WAL. Two processes opening a new database at once can see SQLITE_BUSY here
    without the busy handler's wait, so the switch is retried for a few seconds."""
    for attempt in range(60):
        try:
            db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError:
            if attempt == 59:
                raise
            time.sleep(0.05)

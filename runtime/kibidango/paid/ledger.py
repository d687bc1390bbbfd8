"""The cloud budget ledger: a hard dollar limit per period, shared by every thread and process
that uses one state directory, surviving restarts.

SQLite in WAL mode (``<state dir>/ledger.sqlite``). A cloud call first **reserves** its worst-case
cost: in one ``BEGIN IMMEDIATE`` transaction (one writer at a time, across processes) the
period's settled spend plus its open reservations plus the new amount must stay within the limit,
or nothing is reserved and the caller answers locally. After the call the reservation is
**settled** with the cost the provider's reported usage gives, or **released** when the call failed
before anything could be billed. A cost that cannot be trusted — absent, not a number, negative,
NaN — is charged **at the reservation**, with a warning and ``usage_untrusted`` counted; a reply
never credits the budget. A credible cost **above** its reservation (the worst case was not the
worst case) is recorded at what it reports, never truncated, and puts the ledger on **hold**: no
reservation succeeds, in any process sharing the state directory, until someone checks the
provider's bill and lifts it (:func:`reconcile`, ``kibidango budget --reconcile``). A
reservation whose process died is still counted: it may have been paid, so :meth:`Ledger.reap`
charges it at its reserved amount — the spend can overshoot the truth, never the limit. A
reservation records its process's id and start token (boot id + start time), so a process that
later got the same id (a server restarted after ``kill -9`` as PID 1 of its container) does not
keep a dead one's reservation open.

Periods: ``month`` (UTC ``YYYY-MM``), ``day`` (``YYYY-MM-DD``) or ``total``.
"""

from __future__ import annotations

import logging
import math
import os
import sqlite3
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from kibidango.paid.state import Database, pid_alive, process_token

__all__ = ["BudgetExceeded", "Ledger", "LedgerState", "holds", "period_of", "reconcile", "spend", "trusted_cost"]

log = logging.getLogger("kibidango.paid.ledger")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    id TEXT PRIMARY KEY,
    period TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('reserved', 'settled', 'released')),
    reserved_usd REAL NOT NULL,
    settled_usd REAL,
    pid INTEGER NOT NULL,
    host TEXT NOT NULL,
    note TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS entries_period ON entries (period, state);
CREATE TABLE IF NOT EXISTS holds (
    id TEXT PRIMARY KEY,
    entry TEXT NOT NULL,
    reserved_usd REAL NOT NULL,
    reported_usd REAL NOT NULL,
    note TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    lifted REAL,
    lifted_note TEXT
);
"""
_COLUMNS = {"token": "TEXT", "untrusted": "INTEGER NOT NULL DEFAULT 0"}  # added after the first release


class BudgetExceeded(RuntimeError):
    """The worst-case cost does not fit what is left of the period's budget."""


def period_of(kind: str, when: float | None = None) -> str:
    t = time.gmtime(time.time() if when is None else when)
    if kind == "month":
        return time.strftime("%Y-%m", t)
    if kind == "day":
        return time.strftime("%Y-%m-%d", t)
    if kind == "total":
        return "total"
    raise ValueError(f"budget period {kind!r}: month, day or total")


@dataclass(frozen=True)
class LedgerState:
    period: str
    limit_usd: float
    settled_usd: float
    reserved_usd: float

    @property
    def left_usd(self) -> float:
        return max(0.0, self.limit_usd - self.settled_usd - self.reserved_usd)


class Ledger:
    """``Ledger(state_dir, limit_usd, period="month")``; thread-safe (a connection per thread)."""

    def __init__(self, state_dir: str | Path, limit_usd: float, period: str = "month"):
        if not _dollars(limit_usd):
            raise ValueError(f"budget limit: a finite, non-negative number of dollars, not {limit_usd!r}")
        period_of(period)  # validates
        self._db = _database(state_dir)  # synchronous=FULL: a settled cost survives a power cut
        self.path = self._db.path
        self.limit_usd = float(limit_usd)
        self.period = period
        self._host = os.uname().nodename
        self._token = process_token()
        self.untrusted = 0  # settlements charged at the reservation because the reported cost was not credible
        self.over = 0  # settlements whose credible cost was above their reservation (each put the ledger on hold)

    @staticmethod
    def _totals(db: sqlite3.Connection, period: str) -> tuple[float, float]:
        settled, reserved = db.execute(
            "SELECT COALESCE(SUM(CASE WHEN state='settled' THEN settled_usd END), 0),"
            " COALESCE(SUM(CASE WHEN state='reserved' THEN reserved_usd END), 0)"
            " FROM entries WHERE period = ?",
            (period,),
        ).fetchone()
        return float(settled), float(reserved)

    def reserve(self, usd: float, note: str = "") -> str:
        """Reserve ``usd`` (the call's worst case) or raise :class:`BudgetExceeded`; returns the
        reservation's id."""
        if not _dollars(usd):
            raise ValueError(f"a reservation is a finite, non-negative number of dollars, not {usd!r}")
        period = period_of(self.period)
        with self._db.transaction() as db:
            hold = db.execute(
                "SELECT entry, reserved_usd, reported_usd FROM holds WHERE lifted IS NULL ORDER BY created LIMIT 1"
            ).fetchone()
            if hold is not None:
                raise BudgetExceeded(
                    f"spending is on hold: a reply reported ${hold[2]:.6f} against a ${hold[1]:.6f} reservation "
                    f"(entry {hold[0]}); check the provider's bill, then lift it with `kibidango budget --reconcile` "
                    f"({self.path})"
                )
            settled, reserved = self._totals(db, period)
            if settled + reserved + usd > self.limit_usd + 1e-12:
                left = max(0.0, self.limit_usd - settled - reserved)
                raise BudgetExceeded(
                    f"${usd:.6f} does not fit the ${left:.6f} left of ${self.limit_usd:.2f} ({period})"
                )
            rid = uuid.uuid4().hex
            now = time.time()
            db.execute(
                "INSERT INTO entries (id, period, state, reserved_usd, settled_usd, pid, host, note, created, updated,"
                " token) VALUES (?, ?, 'reserved', ?, NULL, ?, ?, ?, ?, ?, ?)",
                (rid, period, float(usd), os.getpid(), self._host, note[:200], now, now, self._token),
            )
        return rid

    def settle(self, rid: str, usd) -> float:
        """Record what the call cost; returns the amount recorded. ``usd`` is what the provider's
        usage gives, or None when the reply had none: a cost that is not a finite, non-negative
        number is charged at the reservation (:func:`trusted_cost`), never credited; a credible
        cost above the reservation is recorded as reported and puts the ledger on hold (see the
        module)."""
        with self._db.transaction() as db:
            row = db.execute("SELECT state, reserved_usd, note FROM entries WHERE id = ?", (rid,)).fetchone()
            if row is None or row[0] != "reserved":
                raise KeyError(f"reservation {rid}: {'unknown' if row is None else row[0]}")
            reserved = float(row[1])
            amount, trusted = trusted_cost(usd, reserved)
            over = trusted and amount > reserved + 1e-12
            now = time.time()
            db.execute(
                "UPDATE entries SET state='settled', settled_usd=?, updated=?, untrusted=? WHERE id=?",
                (amount, now, 0 if trusted else 1, rid),
            )
            if over:
                db.execute(
                    "INSERT INTO holds (id, entry, reserved_usd, reported_usd, note, created)"
                    " VALUES (?, ?, ?, ?, ?, ?)",
                    (uuid.uuid4().hex, rid, reserved, amount, row[2], now),
                )
        if not trusted:
            self.untrusted += 1
            log.warning(
                f"reservation {rid}: the reported cost {usd!r} is not credible; charged the reserved ${amount:.6f}"
            )
        if over:
            self.over += 1
            log.error(
                f"reservation {rid}: the reply reported ${amount:.6f}, above its ${reserved:.6f} reservation; "
                f"recorded as reported and spending is ON HOLD until `kibidango budget --reconcile` ({self.path})"
            )
        return amount

    def charge(self, usd: float, note: str = "") -> None:
        """Record ``usd`` as spent at once, without a reservation: what earlier runs of the caller
        paid, replayed from its own journal (stage 1D)."""
        if not _dollars(usd):
            raise ValueError(f"a charge is a finite, non-negative number of dollars, not {usd!r}")
        now, period = time.time(), period_of(self.period)
        row = (uuid.uuid4().hex, period, float(usd), float(usd), os.getpid(), self._host, note[:200], now, now)
        with self._db.transaction() as db:
            db.execute(
                "INSERT INTO entries (id, period, state, reserved_usd, settled_usd, pid, host, note, created, updated,"
                " token) VALUES (?, ?, 'settled', ?, ?, ?, ?, ?, ?, ?, ?)",
                (*row, self._token),
            )

    def release(self, rid: str) -> None:
        """The call failed before anything could be billed (refused connection, 4xx before the
        model ran): its reservation is freed."""
        with self._db.transaction() as db:
            db.execute(
                "UPDATE entries SET state='released', updated=? WHERE id=? AND state='reserved'", (time.time(), rid)
            )

    def reap(self) -> int:
        """Charge, at their reserved amounts, the open reservations of processes on this host that
        no longer run (killed mid-call: they may have been billed); returns how many."""
        charged = 0
        with self._db.transaction() as db:
            for rid, pid, token, amount in db.execute(
                "SELECT id, pid, token, reserved_usd FROM entries WHERE state='reserved' AND host=?", (self._host,)
            ).fetchall():
                if not pid_alive(pid, token):
                    db.execute(
                        "UPDATE entries SET state='settled', settled_usd=?, note=note || ' [charged: process died]',"
                        " updated=? WHERE id=?",
                        (amount, time.time(), rid),
                    )
                    charged += 1
        return charged

    def state(self) -> LedgerState:
        period = period_of(self.period)
        settled, reserved = self._totals(self._db.connection(), period)
        return LedgerState(period, self.limit_usd, settled, reserved)


def trusted_cost(usd, reserved: float) -> tuple[float, bool]:
    """``(amount to charge, whether the reported cost was credible)``: a finite, non-negative
    number is charged as is (above ``reserved`` too: never truncated); anything else (None, not a
    number, negative, NaN, infinite) is charged at ``reserved``."""
    return (float(usd), True) if _dollars(usd) else (reserved, False)


def _migrate(db: Database) -> None:
    with db.transaction() as conn:
        for statement in filter(str.strip, _SCHEMA.split(";")):
            conn.execute(statement)
        have = {row[1] for row in conn.execute("PRAGMA table_info(entries)")}
        for column, kind in _COLUMNS.items():
            if column not in have:
                conn.execute(f"ALTER TABLE entries ADD COLUMN {column} {kind}")


def _database(state_dir: str | Path) -> Database:
    db = Database(Path(state_dir) / "ledger.sqlite", synchronous="FULL")
    _migrate(db)
    return db


def holds(state_dir: str | Path) -> list[dict]:
    """The ledger's holds not yet lifted: each reply that reported more than its reservation."""
    rows = (
        _database(state_dir)
        .connection()
        .execute(
            "SELECT id, entry, reserved_usd, reported_usd, note, created FROM holds WHERE lifted IS NULL"
            " ORDER BY created"
        )
        .fetchall()
    )
    keys = ("id", "entry", "reserved_usd", "reported_usd", "note", "created")
    return [dict(zip(keys, row)) for row in rows]


def spend(state_dir: str | Path) -> dict[str, dict[str, float]]:
    """Per period: dollars settled and dollars reserved by calls in flight."""
    rows = (
        _database(state_dir)
        .connection()
        .execute(
            "SELECT period, COALESCE(SUM(CASE WHEN state='settled' THEN settled_usd END), 0),"
            " COALESCE(SUM(CASE WHEN state='reserved' THEN reserved_usd END), 0) FROM entries GROUP BY period"
            " ORDER BY period"
        )
        .fetchall()
    )
    return {period: {"settled_usd": float(a), "reserved_usd": float(b)} for period, a, b in rows}


def reconcile(state_dir: str | Path, note: str = "") -> int:
    """Lift every hold (someone checked the provider's bill; the recorded amounts stand); returns
    how many were lifted."""
    with _database(state_dir).transaction() as db:
        return db.execute(
            "UPDATE holds SET lifted = ?, lifted_note = ? WHERE lifted IS NULL", (time.time(), note[:200])
        ).rowcount


def _dollars(x) -> bool:
    """A finite, non-negative number (not a bool, not NaN)."""
    return not isinstance(x, bool) and isinstance(x, int | float) and 0 <= x < math.inf

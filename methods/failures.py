"""The parts of failure mining (1B) and critique filtering (1C) that are not a stage's own wiring:
which rows are held out from training, a resumable log of judged answers, and how severe a failure
is.

- :func:`training_texts` and :func:`row_key`: a row's instruction and input, normalised, so that
  a benchmark task that stage 0 put in the train split (MBPP's mining half is curated) is never
  "held out";
- :func:`sample`: a deterministic sample (a seeded hash order, so a bigger sample contains the
  smaller one);
- :class:`RowLog`: one JSON line per finished row, appended and fsynced, read back on resume (a
  line torn by a kill is ignored; a later line for the same id wins);
- :func:`severity`: domain weight x how wrong (1 - judge score) x how sure the student was.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

__all__ = ["RowLog", "held_out", "row_key", "sample", "severity", "task_of", "training_texts"]

log = logging.getLogger("kibidango.failures")


def row_key(instruction: str, input_: str = "") -> str:
    """The text identity of a row: instruction and input, case and whitespace folded."""
    return " ".join(f"{instruction}\n{input_}".lower().split())


def training_texts(rows: Iterable[dict]) -> set[str]:
    """:func:`row_key` of every row (stage 0's train split)."""
    return {row_key(r["instruction"], r["input"]) for r in rows}


def task_of(row: dict):
    """The judge task of a 1B/1C table row (it carries the prompt, reference and tests)."""
    from methods.judges import Task

    return Task(
        row["id"],
        row["prompt"],
        row.get("reference", ""),
        tuple(row.get("tests") or ()),
        row.get("entry_point") or None,
        row.get("setup", ""),
    )


def held_out(row_id: str, share: float) -> bool:
    """True for the ``share`` of row ids (by a salted hash) kept out of teaching and training."""
    h = int.from_bytes(hashlib.sha256(f"kibidango/held-out-failures/v1:{row_id}".encode()).digest()[:8], "big")
    return h / 2**64 < share


def sample(items: list, size: int | None, seed: int, key=lambda x: x) -> list:
    """Up to ``size`` of ``items`` in a seeded hash order of ``key(item)`` (all when size is None)."""

    def order(item) -> bytes:
        return hashlib.sha256(f"{seed}:{key(item)}".encode()).digest()

    ranked = sorted(items, key=order)
    return ranked if size is None else ranked[:size]


class RowLog:
    """Finished rows of a resumable stage, one JSON object per line, keyed by ``id``."""

    def __init__(self, path: Path):
        self.path = path
        self.rows: dict[str, dict] = {}
        if path.is_file():
            torn = 0
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    torn += 1  # the line being written when the last attempt was killed
                    continue
                self.rows[row["id"]] = row
            if torn:
                log.warning(f"{path}: {torn} incomplete line(s) from an interrupted attempt ignored")
        self.resumed = len(self.rows)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - held open for appends

    def __contains__(self, row_id: str) -> bool:
        return row_id in self.rows

    def __len__(self) -> int:
        return len(self.rows)

    def get(self, row_id: str) -> dict | None:
        return self.rows.get(row_id)

    def add(self, row: dict) -> None:
        """Append ``row`` durably: once this returns, a kill does not lose it."""
        self._file.write(json.dumps(row, ensure_ascii=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.rows[row["id"]] = row

    def close(self) -> None:
        self._file.close()

    def __iter__(self) -> Iterator[dict]:
        return iter(self.rows.values())


def severity(score: float, confidence: float, domain_weight: float, confidence_weight: float) -> float:
    """``domain_weight * (1 - score) * ((1 - confidence_weight) + confidence_weight * confidence)``:
    a failure the judge scored lower, that the student wrote with more confidence (it does not
    know it is wrong: what retraining and calibration most need), in a domain that matters more."""
    return domain_weight * (1.0 - score) * ((1.0 - confidence_weight) + confidence_weight * confidence)

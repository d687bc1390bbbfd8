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
- :func:`severity`: domain weight x how wrong (1 - judge score) x how sure the student was;
- :data:`FAILURES` and :func:`failure_rate`: what counts as a failure, and the rate over verdicts;
- :func:`read_jsonl`, :func:`mined_judges` and :func:`answered_tasks`: what the downstream stages
  (1C, 1D, 1R, 2D, 3-5 and the next round's 1B) read of their inputs;
- :func:`task_record`, :func:`verdict_record`: the JSON records of a task and a verdict (1B, 2G,
  9 and ``make eval-cascade``; the tasks themselves: :mod:`methods.heldout`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

from core.contract import KibidangoError
from methods.benchmarks import unit_hash
from methods.journal import Journal
from methods.judges import Task

__all__ = [
    "FAILURES",
    "RowLog",
    "answered_tasks",
    "failure_rate",
    "held_out",
    "loop_mix",
    "mined_judges",
    "own_passes",
    "read_jsonl",
    "row_key",
    "sample",
    "severity",
    "task_of",
    "task_record",
    "verdict_record",
    "training_texts",
]

log = logging.getLogger("kibidango.failures")

FAILURES = ("failed", "timeout", "error")
"""Outcomes that are failures of the answer; a ``judge_error`` is no verdict on it."""


def failure_rate(outcomes: Iterable[str]) -> tuple[float, int, int]:
    """``(failed / judged, failed, judged)`` over verdict outcomes; judge errors are not judged."""
    outcomes = list(outcomes)
    judged = sum(1 for o in outcomes if o != "judge_error")
    failed = sum(1 for o in outcomes if o in FAILURES)
    return (failed / judged if judged else 0.0), failed, judged


def read_jsonl(path: Path, what: str) -> list[dict]:
    """The rows of a JSONL file an upstream stage wrote; ``what`` names the input and its stage
    for the error (``"the mined input (stage 1B)"``)."""
    if not path.is_file():
        raise KibidangoError(f"{what} has no {path.name}: {path}")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def answered_tasks(mined_dir: Path, what: str) -> tuple[int, frozenset[str]]:
    """``(round, ids)``: the round a stage 1B output mined and every ladder task it and the rounds
    before it answered (its ``answered_tasks.json``), which no later stage may count as held out
    nor mine again. ``what`` names the input for the error (``"the previous round's 1B output"``)."""
    where = mined_dir / "answered_tasks.json"
    if not where.is_file():
        raise KibidangoError(f"{what} has no answered_tasks.json ({where}): is it stage 1B's output?")
    done = json.loads(where.read_text())
    return int(done["round"]), frozenset(done["ids"])


def mined_judges(mined_dir: Path) -> dict:
    """The judges stage 1B judged with (its recipe's ``judges``, from its manifest): later stages
    judge new answers exactly as 1B did."""
    from methods.judges import make_judges

    return make_judges(json.loads((mined_dir / "manifest.json").read_text())["config"]["judges"])


def row_key(instruction: str, input_: str = "") -> str:
    """The text identity of a row: instruction and input, case and whitespace folded."""
    return " ".join(f"{instruction}\n{input_}".lower().split())


def training_texts(rows: Iterable[dict]) -> set[str]:
    """:func:`row_key` of every row (stage 0's train split)."""
    return {row_key(r["instruction"], r["input"]) for r in rows}


def task_of(row: dict):
    """The judge task of a 1B/1C table row (it carries the prompt, reference and tests)."""

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
    return unit_hash(f"kibidango/held-out-failures/v1:{row_id}") < share


def sample(items: list, size: int | None, seed: int, key=lambda x: x) -> list:
    """Up to ``size`` of ``items`` in a seeded hash order of ``key(item)`` (all when size is None)."""

    def order(item) -> bytes:
        return hashlib.sha256(f"{seed}:{key(item)}".encode()).digest()

    ranked = sorted(items, key=order)
    return ranked if size is None else ranked[:size]


class RowLog:
    """Finished rows of a resumable stage, keyed by ``id`` (a later line for an id wins), over a
    :class:`methods.journal.Journal`."""

    def __init__(self, path: Path):
        self._journal = Journal(path, check=lambda row: None if isinstance(row.get("id"), str) else "no row id")
        # a torn last line (a kill mid-write) is a row not finished: it is done again
        self.rows: dict[str, dict] = {row["id"]: row for row in self._journal.events if row.get("event") != "torn"}
        self.resumed = len(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def get(self, row_id: str) -> dict | None:
        return self.rows.get(row_id)

    def add(self, row: dict) -> None:
        """Append ``row`` durably: once this returns, a kill does not lose it."""
        self._journal.write(row)
        self.rows[row["id"]] = row

    def close(self) -> None:
        self._journal.close()

    def __iter__(self) -> Iterator[dict]:
        return iter(self.rows.values())


def loop_mix(
    pairs: list[dict],
    replay_from: list[dict],
    replay_share: float,
    pair_repeats: int,
    seed: int,
    own: list[dict] = (),
    own_share: float = 0.0,
):
    """The retraining round's mix (stage 1R; 2F trains on it again): each corrected pair
    ``pair_repeats`` times, and replay rows so that they are ``replay_share`` of the mix: up to
    ``own_share`` of them drawn from ``own`` (the student's own passing answers, :func:`own_passes`;
    per domain in the pairs' proportions, as many as there are), the rest from ``replay_from``
    (stage 0's train split), each drawn seeded. Returns (pair rows, replay rows)."""
    train_rows = [r for r in pairs for _ in range(pair_repeats)]
    n_replay = round(len(train_rows) * replay_share / (1 - replay_share))
    mine = []
    if own and own_share > 0 and pairs:
        want = Counter(p["domain"] for p in pairs)
        n_own = round(n_replay * own_share)
        for domain, k in sorted(want.items()):
            pool = [r for r in own if r["domain"] == domain]
            mine += sample(pool, min(len(pool), round(n_own * k / len(pairs))), seed, key=lambda r: r["id"])
    return train_rows, mine + sample(replay_from, n_replay - len(mine), seed, key=lambda r: r["id"])


def own_passes(answered: Iterable[dict], exclude: set[str] = frozenset()) -> list[dict]:
    """Training rows (id, domain, instruction, input, output) of the answers 1B's judges passed,
    the student's own (``exclude``: ids that must not be trained on): what rejection-sampling
    fine-tuning keeps of the tasks a model already solves (STaR, Zelikman et al. 2022; RFT, Yuan et
    al. 2023), rehearsed beside the corrections so that teaching the band's failures does not
    unlearn its passes. An answer passed with working the judge found wrong is left out."""
    return [
        {k: r[k] for k in ("id", "domain", "instruction", "input")} | {"output": r["answer"]}
        for r in answered
        if r.get("passed") is True
        and not r.get("wrong_working")
        and not r.get("format_failure")
        and r.get("answer")
        and r["id"] not in exclude
    ]


def severity(score: float, confidence: float, domain_weight: float, confidence_weight: float) -> float:
    """``domain_weight * (1 - score) * ((1 - confidence_weight) + confidence_weight * confidence)``:
    a failure the judge scored lower, that the student wrote with more confidence (it does not
    know it is wrong: what retraining and calibration most need), in a domain that matters more."""
    return domain_weight * (1.0 - score) * ((1.0 - confidence_weight) + confidence_weight * confidence)


def task_record(row: dict) -> dict:
    """The JSON fields of a selected task (:func:`select_tasks`): what later stages judge by."""
    t = row["task"]
    return {
        "id": row["id"],
        "sample": row["sample"],
        "source": row["source"],
        "domain": row["domain"],
        "level": row.get("level", 0),  # a ladder task's level; 0 for tasks without one
        "prompt": t.prompt,
        "instruction": row["instruction"],
        "input": row["input"],
        "reference": t.reference,
        # the task itself, so that later stages (1D) judge new answers without the source files
        "tests": list(t.tests),
        "entry_point": t.entry_point or "",
        "setup": t.setup,
    }


def verdict_record(v, kind: str) -> dict:
    """The JSON fields of a judge's verdict."""
    return {
        "outcome": v.outcome,
        "passed": bool(v.passed),
        "score": float(v.score),
        "reason": v.reason,
        "judge": kind,
        "judge_seconds": float(v.cost),
        "judge_usd": float(v.details.get("usd", 0.0)),
        "retryable": bool(v.details.get("retryable", False)),
        "format_failure": bool(v.details.get("format_failure")),
        "wrong_working": bool(v.details.get("wrong_working")),
    }

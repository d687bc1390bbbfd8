"""Verifiable benchmarks (GSM8K test, MBPP, HumanEval) as judge tasks, and their one split into a
**mining** part and an **evaluation** part.

Each task belongs to one part forever, by a salted hash of its benchmark and task id
(:func:`part`): failure mining (1B), critique filtering (1C), cascaded teachers (1D) and the
retraining round may read the mining part; the evaluation part is read by evaluation and quality
gates only. Stage 0 never reads an evaluation task either: a source that is a benchmark's file names
it (``SourceSpec.benchmark``) and its evaluation rows are held out as they are read.

Task ids: MBPP ``mbpp/<task_id>``, HumanEval its ``task_id`` (``HumanEval/0``), GSM8K
``gsm8k/<file>:<line>`` (the test file has no ids; its line number is stable).

Files are read with stage 0's reader (:func:`methods.curation.ingest.records`): the same bytes
handling, and unreadable rows are reported with their file and line rather than skipped silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from core.contract import KibidangoError
from methods.curation.example import Reject, normalize_text
from methods.curation.ingest import FieldError, SourceSpec, parse_record, records
from methods.curation.split import BENCHMARKS, EVALUATION_SHARE, part, task_id, unit_hash
from methods.judges.base import Task

__all__ = [
    "BENCHMARKS",
    "EVALUATION_SHARE",
    "BenchmarkTask",
    "load_tasks",
    "part",
    "task_id",
    "unit_hash",
]


@dataclass(frozen=True)
class BenchmarkTask:
    benchmark: str
    domain: str
    judge: str
    part: str
    task: Task
    curated: tuple[str, str]
    """(instruction, input) exactly as stage 0 curates the row (its own reader): the student's format."""

    @property
    def id(self) -> str:
        return self.task.id

    def instruction(self) -> tuple[str, str]:
        """(instruction, input) as stage 0 curates this benchmark's rows: the student's own format."""
        return self.curated


def load_tasks(benchmark: str, path: str | Path, which: str | None = None) -> list[BenchmarkTask]:
    """Every task of ``benchmark``'s file at ``path`` (of part ``which``, or both), in file order.
    A row that cannot be read or lacks a field is an error naming the file, line and field."""
    if benchmark not in BENCHMARKS:
        raise KibidangoError(f"unknown benchmark {benchmark!r}; known: {', '.join(BENCHMARKS)}")
    meta = BENCHMARKS[benchmark]
    spec = SourceSpec(name=benchmark, path=str(path), format=meta["format"], license="-")
    if not spec.is_present():
        raise KibidangoError(f"benchmark {benchmark}: file not found: {path}")
    out = []
    for line, rec in records(spec):
        if isinstance(rec, Reject):
            raise KibidangoError(f"benchmark {benchmark}: {rec.message()}")
        tid = task_id(benchmark, rec, line, str(path))
        p = part(benchmark, tid)
        if which is not None and p != which:
            continue
        try:
            task = _task(benchmark, tid, rec)
            instruction, input_, _ = parse_record(meta["format"], rec, {})
        except KeyError as e:
            raise KibidangoError(f"benchmark {benchmark}: {path}:{line}: field {e.args[0]!r} is missing") from None
        except FieldError as e:
            raise KibidangoError(f"benchmark {benchmark}: {path}:{line}: field {e.field!r}: {e.reason}") from None
        curated = (normalize_text(instruction), normalize_text(input_))
        out.append(BenchmarkTask(benchmark, meta["domain"], meta["judge"], p, task, curated))
    return out


def _task(benchmark: str, tid: str, rec: dict) -> Task:
    if benchmark == "gsm8k":
        return Task(tid, normalize_text(rec["question"]), reference=rec["answer"])
    if benchmark == "mbpp":
        tests = tuple(rec["test_list"])
        prompt = normalize_text(rec["text"] if "text" in rec else rec["prompt"])
        return Task(tid, prompt, reference=rec.get("code", ""), tests=tests, setup=rec.get("test_setup_code") or "")
    # HumanEval: the prompt is the function's signature and docstring; an answer that is only a
    # body is appended to it (methods.judges.code).
    return Task(
        tid,
        rec["prompt"],
        reference=rec.get("canonical_solution", ""),
        tests=(rec["test"],),
        entry_point=rec["entry_point"],
    )

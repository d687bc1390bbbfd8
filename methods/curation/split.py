"""The one split of each verifiable benchmark into a **mining** part and an **evaluation** part, by
a salted hash of its benchmark and task id (see :mod:`methods.benchmarks`). Stage 0's reader holds
a benchmark file's evaluation rows out with it, so it sits below both."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Literal

from core.contract import KibidangoError

__all__ = ["BENCHMARKS", "EVALUATION_SHARE", "part", "task_id", "unit_hash"]

Benchmark = Literal["gsm8k", "mbpp", "humaneval"]
BENCHMARKS: dict[str, dict] = {
    "gsm8k": {"domain": "math", "judge": "math", "format": "gsm8k"},
    "mbpp": {"domain": "code", "judge": "code", "format": "mbpp"},
    "humaneval": {"domain": "code", "judge": "code", "format": "humaneval"},
}

EVALUATION_SHARE = 0.5
"""Share of each benchmark's tasks in the evaluation part."""
_SALT = "kibidango/benchmark-split/v1"
"""Changing this (or EVALUATION_SHARE) moves tasks between parts: every trained model is then
contaminated for evaluation. Never change it."""


def task_id(benchmark: str, record: dict, line: int, file: str = "") -> str:
    """The id of the task in ``record`` (read at ``line`` of ``file``)."""
    if benchmark == "mbpp":
        return f"mbpp/{record.get('task_id', f'line{line}')}"
    if benchmark == "humaneval":
        return str(record.get("task_id") or f"HumanEval/line{line}")
    if benchmark == "gsm8k":
        return f"gsm8k/{Path(file).name}:{line}"
    raise KibidangoError(f"unknown benchmark {benchmark!r}; known: {', '.join(BENCHMARKS)}")


def unit_hash(key: str) -> float:
    """``key`` hashed to [0, 1) (the first 64 bits of its sha256): a share of keys picked by it
    stays picked whatever else is added."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64


def part(benchmark: str, tid: str) -> Literal["mining", "evaluation"]:
    """The part ``tid`` of ``benchmark`` belongs to, forever."""
    return "evaluation" if unit_hash(f"{_SALT}:{benchmark}:{tid}") < EVALUATION_SHARE else "mining"

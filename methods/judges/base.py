"""The judge interface: a task, an answer, a verdict."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal, Protocol

__all__ = ["Judge", "Outcome", "Task", "Verdict"]

Outcome = Literal["passed", "failed", "timeout", "error", "judge_error"]


@dataclass(frozen=True)
class Task:
    """What an answer is judged against. ``reference``: the gold answer (math: the text holding the
    final number; reference: the answer text). ``tests``: code the program must pass (MBPP asserts,
    or HumanEval's ``check`` function with ``entry_point``)."""

    id: str
    prompt: str
    reference: str = ""
    tests: tuple[str, ...] = ()
    entry_point: str | None = None
    setup: str = ""
    """Code run before the tests (MBPP's ``test_setup_code``)."""


@dataclass(frozen=True)
class Verdict:
    """``passed`` is True only for an answer shown right; a judge that could not decide says
    ``outcome="judge_error"`` and ``passed=False`` (never a pass). ``score`` is in [0, 1];
    ``cost`` the judge's wall seconds."""

    passed: bool
    score: float
    reason: str
    outcome: Outcome
    cost: float = 0.0
    details: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


class Judge(Protocol):
    kind: str

    def __call__(self, task: Task, answer: str) -> Verdict: ...

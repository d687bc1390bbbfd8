"""The task ladder: generated, seeded, verifiable tasks with a difficulty level, so that any model,
4.5M parameters or 8B, has a frontier inside the suite where the quality loop has something to find.

- **math** (:mod:`methods.ladder.arithmetic`): word problems with a worked solution and a ``#### n``
  answer, judged by the math judge; levels 1-7 by digits, operations and carries;
- **code** (:mod:`methods.ladder.programs`): MBPP-style Python functions with assert tests and a
  reference solution, judged by the code judge; levels 1-6 by composition depth.

Every task has a stable id (``ladder-math-3-<hash of its key>``): the key is the problem itself —
its story and arithmetic, or the program — not its wording, so one problem told twice is one
task. Each task belongs to one **part** forever, by a salted hash of its key
(:func:`part`), as the benchmarks' tasks do (:mod:`methods.benchmarks`): **evaluation** (20%: read by
evaluation and gates only), **mining** (20%: failure mining, teachers, retraining, calibration) and
**train** (60%: stage 0). Stage 0 reads the train part of the levels up to its cut-off
(:class:`LadderSource`); above it no stage trains on a level's rows before the loop does, so the
frontier is reached by mining and retraining, not by plain SFT. The part never depends on the seed
or the cut-off: a seed only changes the wording and which problems are drawn first.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from pydantic import Field, model_validator

from core.contract import StageConfig
from methods.curation.split import unit_hash
from methods.judges.base import Task
from methods.ladder import arithmetic, programs

__all__ = [
    "DOMAINS",
    "EVALUATION_SHARE",
    "LEVELS",
    "MINING_SHARE",
    "LadderSource",
    "LadderTask",
    "check_levels",
    "ladder_rows",
    "ladder_tasks",
    "part",
]

Domain = Literal["math", "code"]
Part = Literal["train", "mining", "evaluation"]
DOMAINS: tuple[str, ...] = ("math", "code")
LEVELS: dict[str, int] = {"math": arithmetic.LEVELS, "code": programs.LEVELS}
EVALUATION_SHARE = 0.2
MINING_SHARE = 0.2
_SALT = "kibidango/ladder-split/v1"
"""Changing this or the shares moves tasks between parts: every trained model is then contaminated
for evaluation. Never change them."""
_PATIENCE = 2000
"""Draws in a row that bring no new problem before a level counts as exhausted (every level has
thousands of problems or more)."""


def part(domain: str, key: str) -> Part:
    """The part of the problem ``key`` of ``domain``, forever."""
    u = unit_hash(f"{_SALT}:{domain}:{key}")
    return "evaluation" if u < EVALUATION_SHARE else "mining" if u < EVALUATION_SHARE + MINING_SHARE else "train"


@dataclass(frozen=True)
class LadderTask:
    id: str
    domain: str
    level: int
    part: Part
    instruction: str
    input: str
    output: str
    """The worked solution (math) or the reference program (code): what training rows answer."""
    task: Task
    """What the judge reads (math: the solution as reference; code: the tests)."""
    difficulty: int
    """The measured difficulty: single-digit operations (math) or AST nodes of the reference (code)."""


def _task(domain: str, level: int, rng: random.Random) -> tuple[str, str, str, str, tuple[str, ...], int]:
    """(key, instruction, input, output, tests, difficulty) of one generated problem."""
    if domain == "math":
        p = arithmetic.problem(level, rng)
        return p.key, p.question, "", p.solution, (), arithmetic.digit_steps(p.steps)
    if domain == "code":
        g = programs.program(level, rng)
        shown = f"Your code should pass this test:\n{g.tests[0]}"
        return g.key, g.instruction, shown, g.reference, g.tests, programs.ast_nodes(g.reference)
    raise ValueError(f"unknown ladder domain {domain!r}; known: {', '.join(DOMAINS)}")


def _generate(domain: str, level: int, seed: int) -> Iterator[LadderTask]:
    """Every distinct problem of ``domain`` at ``level``, in the order ``seed`` draws them, until
    :data:`_PATIENCE` draws in a row bring nothing new."""
    if not 1 <= level <= LEVELS.get(domain, 0):
        raise ValueError(f"ladder {domain}: level {level} is not in 1..{LEVELS.get(domain, '?')}")
    seen: set[str] = set()
    since_new = 0
    draw = 0
    while since_new < _PATIENCE:
        rng = random.Random(f"kibidango-ladder:{seed}:{domain}:{level}:{draw}")
        draw += 1
        key, instruction, input_, output, tests, difficulty = _task(domain, level, rng)
        if key in seen:
            since_new += 1
            continue
        seen.add(key)
        since_new = 0
        tid = f"ladder-{domain}-{level}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
        prompt = "\n\n".join(p for p in (instruction, input_) if p)
        task = Task(tid, prompt, reference=output, tests=tests)
        yield LadderTask(tid, domain, level, part(domain, key), instruction, input_, output, task, difficulty)


def ladder_tasks(
    domain: str, level: int, which: Part, n: int, seed: int = 0, exclude: frozenset[str] = frozenset()
) -> list[LadderTask]:
    """The first ``n`` tasks of part ``which`` at ``level`` of ``domain`` (fewer when the level has
    fewer), less those whose id is in ``exclude`` (an earlier round's): deterministic in ``seed``,
    and a bigger ``n`` extends a smaller one."""
    out: list[LadderTask] = []
    if n <= 0:
        return out
    for t in _generate(domain, level, seed):
        if t.part == which and t.id not in exclude:
            out.append(t)
            if len(out) == n:
                break
    return out


def check_levels(sample: str, domain: str | None, levels: list[int] | None) -> None:
    """A recipe's ladder sample names a domain and levels the ladder has (a ValueError naming it)."""
    if domain not in LEVELS:
        raise ValueError(f"sample {sample!r}: ladder domain {domain!r} is not one of {', '.join(DOMAINS)}")
    if not levels or any(not 1 <= level <= LEVELS[domain] for level in levels) or len(set(levels)) < len(levels):
        raise ValueError(f"sample {sample!r}: `levels` must be distinct levels of {domain}, 1..{LEVELS[domain]}")


def ladder_rows(
    domain: str, levels: list[int], which: Part, size: int, seed: int = 0, exclude: frozenset[str] = frozenset()
) -> list[dict]:
    """``size`` tasks of part ``which``, spread evenly over ``levels`` (the first levels take the
    remainder), less ``exclude``, as the held-out stages' rows: ``{id, instruction, input, task, level}``."""
    rows = []
    for i, level in enumerate(levels):
        n = size // len(levels) + (i < size % len(levels))
        for t in ladder_tasks(domain, level, which, n, seed, exclude):
            rows.append({"id": t.id, "instruction": t.instruction, "input": t.input, "task": t.task, "level": level})
    return rows


class LadderSource(StageConfig):
    """A stage-0 source of ladder rows: the **train** part of one domain's levels up to a cut-off."""

    domain: Domain = Field(description="math or code.")
    train_max_level: int = Field(
        ge=1,
        description="Levels 1..this are read; the levels above stay out of training, for the loop to reach.",
    )
    per_level: int = Field(gt=0, description="Rows per level (fewer where a level holds fewer problems).")
    seed: int = Field(0, description="Wording and draw order; never which part a problem belongs to.")

    @model_validator(mode="after")
    def _levels(self) -> LadderSource:
        if self.train_max_level > LEVELS[self.domain]:
            raise ValueError(f"ladder {self.domain}: train_max_level {self.train_max_level} > {LEVELS[self.domain]}")
        return self

    def rows(self) -> Iterator[LadderTask]:
        for level in range(1, self.train_max_level + 1):
            yield from ladder_tasks(self.domain, level, "train", self.per_level, self.seed)

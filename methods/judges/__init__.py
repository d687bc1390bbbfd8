"""Judges: does an answer solve its task? One interface, ``judge(task, answer) -> Verdict``, and
one kind per way of knowing:

- ``math`` (:mod:`methods.judges.math`): the final number against the reference, exactly;
- ``code`` (:mod:`methods.judges.code`): the program run against the task's tests in a sandbox;
- ``reference`` (:mod:`methods.judges.reference`): chrF against the gold answer, with a threshold;
- ``llm`` (:mod:`methods.judges.llm`): a rubric prompt to an OpenAI-compatible endpoint, the reply
  parsed as JSON against a schema.

Judges are pure library code: stages (failure mining, critique filtering, gates) and evaluation
scripts build one with :func:`make_judge` from a recipe's settings.
"""

from __future__ import annotations

from methods.judges.base import Judge, Task, Verdict

__all__ = ["Judge", "Task", "Verdict", "make_judge"]


def make_judge(kind: str, **settings) -> Judge:
    """A judge of ``kind`` ("math", "code", "reference", "llm") with the recipe's ``settings``."""
    if kind == "math":
        from methods.judges.math import MathJudge

        return MathJudge(**settings)
    if kind == "code":
        from methods.judges.code import CodeJudge

        return CodeJudge(**settings)
    if kind == "reference":
        from methods.judges.reference import ReferenceJudge

        return ReferenceJudge(**settings)
    if kind == "llm":
        from methods.judges.llm import LLMJudge

        return LLMJudge(**settings)
    raise ValueError(f"unknown judge kind {kind!r}; known: math, code, reference, llm")

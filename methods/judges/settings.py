"""A recipe's judge settings as types: one model per judge kind, told apart by ``kind`` (a tagged
union, :data:`JudgeSettings`), checked when the recipe is read — an unknown setting, a missing one
or a value out of range is refused naming the domain and the field, before a stage starts and
without reading any key. :func:`methods.judges.make_judge` builds the judge from them."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from methods.judges.llm import LLMJudgeSettings

__all__ = [
    "CodeJudgeSettings",
    "JudgeSettings",
    "LLMJudgeSettings",
    "MathJudgeSettings",
    "ReferenceJudgeSettings",
    "judge_settings",
]


class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MathJudgeSettings(_Settings):
    kind: Literal["math"] = "math"
    working: bool = Field(
        False,
        description="Also fail an answer whose own arithmetic is wrong (an equation between plain numbers, "
        "`41 + 57 = 58`, that does not hold), whatever its final number (methods/judges/math.py).",
    )


class CodeJudgeSettings(_Settings):
    kind: Literal["code"] = "code"
    wall_seconds: float = Field(10.0, gt=0, description="Wall-clock limit of one answer's run.")
    cpu_seconds: int = Field(5, gt=0, description="CPU-time limit (RLIMIT_CPU).")
    memory_mb: int = Field(
        1024,
        gt=0,
        description="Memory limit: per process (RLIMIT_AS), and for all the answer's processes together where the "
        "sandbox gets a cgroup of its own.",
    )
    weak_sandbox_ok: bool = Field(
        False, description="Judge code without bubblewrap (unshare + audit hook): weaker isolation, opted into."
    )
    attempts: int = Field(
        3, ge=1, le=10, description="Runs of an answer whose sandbox failed (the machine's fault, never the answer's)."
    )


class ReferenceJudgeSettings(_Settings):
    kind: Literal["reference"] = "reference"
    threshold: float = Field(0.4, ge=0, le=1, description="chrF++ at or above which the answer passes.")
    word_order: int = Field(2, ge=0, description="chrF's word n-gram order (2: chrF++).")


JudgeSettings = Annotated[
    MathJudgeSettings | CodeJudgeSettings | ReferenceJudgeSettings | LLMJudgeSettings, Field(discriminator="kind")
]
"""One judge's settings: ``{kind: math|code|reference|llm, ...}``."""

_ADAPTER: TypeAdapter = TypeAdapter(JudgeSettings)


def judge_settings(value) -> MathJudgeSettings | CodeJudgeSettings | ReferenceJudgeSettings | LLMJudgeSettings:
    """``value`` (settings, or their dict as a recipe or a manifest holds them) as settings."""
    return value if isinstance(value, _Settings) else _ADAPTER.validate_python(value)

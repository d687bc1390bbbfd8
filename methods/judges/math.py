"""The math judge: the answer's final number against the reference's, exactly.

The final number is the one after GSM8K's ``####``, else after "the answer is", else the last
number in the text. Thousands separators, currency and percent signs, units after the number and
a trailing ``.0`` are ignored; fractions and decimals compare as exact rationals (``0.5 == 1/2``).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from fractions import Fraction

from methods.judges.base import Task, Verdict

__all__ = ["MathJudge", "final_number"]

_NUMBER = r"-?\$?\s?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?"
_MARKED = [re.compile(r"####\s*(" + _NUMBER + ")"), re.compile(r"answer is[:\s]*(" + _NUMBER + ")", re.IGNORECASE)]
_ANY = re.compile(_NUMBER)


def _value(text: str) -> Fraction | None:
    t = text.replace("$", "").replace(",", "").replace(" ", "")
    try:
        if "/" in t:
            num, den = t.split("/", 1)
            return Fraction(Fraction(num), Fraction(den)) if Fraction(den) != 0 else None
        return Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None


def final_number(text: str) -> Fraction | None:
    """The final number of ``text`` (see the module docstring), or None."""
    for pattern in _MARKED:
        found = pattern.findall(text)
        if found:
            return _value(found[-1])
    found = _ANY.findall(text)
    return _value(found[-1]) if found else None


@dataclass
class MathJudge:
    kind: str = "math"

    def __call__(self, task: Task, answer: str) -> Verdict:
        started = time.monotonic()
        want = final_number(task.reference)
        if want is None:
            return Verdict(
                False, 0.0, f"the reference of {task.id} holds no number", "judge_error", time.monotonic() - started
            )
        got = final_number(answer)
        if got is None:
            return Verdict(False, 0.0, "no number in the answer", "failed", time.monotonic() - started)
        ok = got == want
        reason = f"final number {_show(got)} {'equals' if ok else 'differs from'} the reference {_show(want)}"
        return Verdict(ok, float(ok), reason, "passed" if ok else "failed", time.monotonic() - started)


def _show(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{float(x):g}"

"""The math judge: the answer's final number against the reference's, exactly.

The final number is the one after GSM8K's ``####``, else after "the answer is", else the last
number in the text. Thousands separators, currency and percent signs, units after the number and
a trailing ``.0`` are ignored; fractions and decimals compare as exact rationals (``0.5 == 1/2``).
An answer that marks several different final numbers (``#### 38 #### 21 #### 29``) fails: a list of
guesses is not an answer, whichever of them comes last.

``working`` (off by default: GSM8K is scored on the final number) also fails an answer whose own
arithmetic is wrong — an equation between plain numbers (``41 + 57 = 58``) that does not hold
(:func:`wrong_working`): a right final number reached through wrong working is luck, and where a
passing answer becomes training data (stage 1D's self-taught tier samples until one passes) it
teaches the wrong sum.

:func:`underived` is stricter still, for an answer written with the final number in view (stage
1D's hinted self tier, STaR's rationalization): its working must *derive* the number — the
final number is the result of a chain of equations that start from the question's numbers — so a
copied number beside unrelated, true arithmetic (``4 * 5 = 20 #### 37``) is no worked answer.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from fractions import Fraction

from methods.judges.base import Task, Verdict

__all__ = ["MathJudge", "final_number", "marked_numbers", "through_mark", "underived", "wrong_working"]

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


def marked_numbers(text: str) -> list[Fraction]:
    """The numbers ``text`` marks as its answer (after ``####``, else after "the answer is"), in
    order; none when it marks none."""
    for pattern in _MARKED:
        found = [v for v in map(_value, pattern.findall(text)) if v is not None]
        if found:
            return found
    return []


def final_number(text: str) -> Fraction | None:
    """The final number of ``text`` (see the module docstring), or None."""
    marked = marked_numbers(text)
    if marked:
        return marked[-1]
    found = _ANY.findall(text)
    return _value(found[-1]) if found else None


def through_mark(text: str) -> str:
    """``text`` up to the end of its last ``#### n`` mark: what a model wrote after its answer
    (``#### 164 ≠ 4 Spaces``) is no part of it, and a training pair made of it would teach it."""
    marks = list(_MARKED[0].finditer(text))
    return text[: marks[-1].end()].rstrip() if marks else text


_PLAIN = r"\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_EQUATION = re.compile(rf"({_PLAIN}(?:\s*[-+*/×x]\s*{_PLAIN})+)\s*=\s*(-?{_PLAIN})")
_TOKEN = re.compile(rf"{_PLAIN}|[-+*/×x]")


def _evaluate(expression: str) -> Fraction:
    """``expression`` (plain numbers and + - * × x) with products before sums."""
    tokens = [t.strip() for t in _TOKEN.findall(expression)]
    terms, signs = [_value(tokens[0])], []
    for op, number in zip(tokens[1::2], tokens[2::2], strict=True):
        if op in "*×x":
            terms[-1] *= _value(number)
        else:
            signs.append(op)
            terms.append(_value(number))
    total = terms[0]
    for op, value in zip(signs, terms[1:], strict=True):
        total = total + value if op == "+" else total - value
    return total


def wrong_working(text: str) -> list[str]:
    """The equations of ``text`` between plain numbers whose arithmetic does not hold
    (``41 + 57 = 58``). Conservative: an equation whose left side continues an expression
    (after an operator, a bracket, a number or inside a word) or whose right side runs on (into a
    percent, a fraction, a word, or more arithmetic: ``= 4000 + 2040``, a mixed number ``1 1/2``) is
    not read, so a chained step (``7 + 9 + 1 = 17`` is read whole), a bracketed one or one worked in
    stages is never judged by a part; nor is one with a division (fractions, rates and rounded
    quotients: ``17 / 3 = 5``). On GSM8K's 8,792 worked solutions (test and train) it flags 14: most
    are the dataset's own slips (``2*8 = 24``, ``70 + 40 = 100``), a few notation (``0900-0130 = 0730``);
    on the task ladder's solutions, none."""
    wrong = []
    for m in _EQUATION.finditer(text):
        before, after = text[: m.start()], text[m.end() : m.end() + 1]
        if before[-1:].isalnum() or before[-1:] in (".", ",", "_"):
            continue
        if before.rstrip()[-1:] in ("-", "+", "*", "/", "×", "x", "(", ")", "^", "%") or before.rstrip()[-1:].isdigit():
            continue
        if after.isalnum() or after in ("%", "/", "^", "(", "_"):
            continue
        rest = text[m.end() :].lstrip(" \t")[:1]  # the right side runs on: partly worked (= 4000 + 2040), 1 1/2
        if rest.isdigit() or rest in ("-", "+", "*", "/", "×", "x", "("):
            continue
        if "/" in m.group(1):  # a fraction, a rate or a rounded quotient (17 / 3 = 5, 31 / 3 = 10.33): not read
            continue
        if _evaluate(m.group(1)) != _value(m.group(2)):
            wrong.append(" ".join(m.group(0).split()))
    return wrong


_OPERAND = re.compile(_PLAIN)


def underived(question: str, answer: str) -> str | None:
    """Why ``answer``'s working does not derive its final number from ``question``, or None when it
    does: the final number must be the result of the last *derived* equation, one whose numbers are
    all the question's or earlier derived results. Equations on other numbers (a column sum's
    digits, ``4 + 6 = 10`` inside ``54 + 6 = 60``) are the working of a step, not a step. The
    arithmetic itself is :func:`wrong_working`'s to check."""
    known = {v for v in map(_value, _ANY.findall(question)) if v is not None}
    last = None
    for m in _EQUATION.finditer(answer):
        if all(_value(x) in known for x in _OPERAND.findall(m.group(1))):
            last = _value(m.group(2))
            known.add(last)
    if last is None:
        return "no step combines the question's numbers"
    final = final_number(answer)
    if final != last:
        shown = _show(final) if final is not None else "(none)"
        return f"the final number {shown} is not the last step's result {_show(last)}"
    return None


@dataclass
class MathJudge:
    kind: str = "math"
    working: bool = False

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
        stated = list(dict.fromkeys(marked_numbers(answer)))
        if len(stated) > 1:
            shown = ", ".join(_show(x) for x in stated[:5]) + (", ..." if len(stated) > 5 else "")
            reason = f"{len(stated)} different final numbers ({shown}): a list of guesses"
            return Verdict(False, 0.0, reason, "failed", time.monotonic() - started, {"guesses": len(stated)})
        ok = got == want
        wrong = wrong_working(answer) if self.working and ok else []
        if wrong:
            more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
            reason = f"final number {_show(got)} equals the reference, but its own working is wrong: {wrong[0]}{more}"
            return Verdict(False, 0.0, reason, "failed", time.monotonic() - started, {"wrong_working": wrong})
        reason = f"final number {_show(got)} {'equals' if ok else 'differs from'} the reference {_show(want)}"
        return Verdict(ok, float(ok), reason, "passed" if ok else "failed", time.monotonic() - started)


def _show(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{float(x):g}"

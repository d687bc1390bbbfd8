"""The math rungs: arithmetic word problems with a worked solution ending in GSM8K's ``#### n``.

A problem is a starting amount — a number, or ``a`` packs of ``b`` (a multiplication) — followed
by events that add or take away. The level fixes the shape and the operands' digits:

====  =================================  =============
level shape                              example
====  =================================  =============
1     one digit + one digit              3 + 4
2     two digits +/- one digit           37 + 5
3     two digits +/- two digits          37 - 18
4     one digit x two digits             6 * 23
5     two digits, two +/- steps          37 + 45 - 18
6     one digit x two digits, one step   6 * 23 - 17
7     one digit x two digits, two steps  6 * 23 - 17 + 45
====  =================================  =============

The measured difficulty is :func:`digit_steps`: the single-digit operations of the schoolbook
algorithm (one per column added or subtracted, one per digit multiplied, one per carry or
borrow). Its mean rises with every level (``tests/test_ladder.py``).

The problem's **key** is its arithmetic with its protagonist and objects (``"5:Tom:shells:37+45-18"``),
as a GSM8K problem is its story and numbers: the same problem told in another template is the same
task, so a split by key never puts one problem on both sides in two wordings. Arithmetic *facts*
are skills, not problems: ``3 + 4`` is asked of Tom's shells in training and of Mia's cards in
evaluation (level 1 has only 81 sums; above it, a repeated sum is rare). Subtractions never go
below zero (the step adds instead).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["LEVELS", "Problem", "digit_steps", "problem", "worked_step"]

LEVELS = 7

_NAMES = ["Lily", "Tom", "Mia", "Ben", "Sue", "Max", "Anna", "Sam", "Lucy", "Jack", "Zoe", "Leo", "Ivy", "Noah"]
_THINGS = ["apples", "stickers", "marbles", "books", "cookies", "shells", "pencils", "stones", "cards", "flowers"]
_CONTAINERS = ["boxes", "bags", "jars", "baskets", "packs"]
_PRONOUN = {name: "she" if name in {"Lily", "Mia", "Sue", "Anna", "Lucy", "Zoe", "Ivy"} else "he" for name in _NAMES}

# Surface templates. {n}: name, {p}: pronoun, {t}: things, {c}: containers, {a} {b}: numbers.
_START = [
    "{n} has {a} {t}.",
    "There are {a} {t} in {n}'s room.",
    "{n} collected {a} {t} last week.",
    "At the start of the day, {n} had {a} {t}.",
]
_START_PACKS = [
    "{n} has {a} {c} with {b} {t} in each.",
    "{n} buys {a} {c} of {t}. Each one holds {b} {t}.",
    "{n} puts {a} {c} on the table, and every one has {b} {t} in it.",
]
_ADD = [
    "Then {p} gets {b} more.",
    "A friend gives {n} {b} more {t}.",
    "{n} finds {b} more {t}.",
    "Later, {p} buys {b} more {t}.",
]
_TAKE = [
    "Then {p} gives away {b} of them.",
    "{n} loses {b} {t}.",
    "{n} gives {b} {t} to a friend.",
    "Later, {p} uses {b} {t}.",
]
_QUESTION = [
    "How many {t} does {n} have now?",
    "How many {t} are there now?",
    "How many {t} does {n} end up with?",
]
_QUESTION_PACKS = [
    "How many {t} does {n} have in all?",
    "How many {t} are there altogether?",
]

# level -> (start digits, or (multiplier digits, multiplicand digits) for packs; event digits, events)
_SHAPES: dict[int, tuple[int | tuple[int, int], int, int]] = {
    1: (1, 1, 1),
    2: (2, 1, 1),
    3: (2, 2, 1),
    4: ((1, 2), 0, 0),
    5: (2, 2, 2),
    6: ((1, 2), 2, 1),
    7: ((1, 2), 2, 2),
}


@dataclass(frozen=True)
class Problem:
    key: str
    """The level, protagonist, objects and arithmetic: ``"5:Tom:shells:37+45-18"``."""
    question: str
    solution: str
    """One line per step, worked column by column (:func:`worked_step`), then ``#### n``."""
    answer: int
    steps: tuple[tuple[str, int, int, int], ...]
    """(operator, left, right, result) per step."""


def _number(rng: random.Random, digits: int) -> int:
    """A number of exactly ``digits`` digits (one digit: 1..9)."""
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


def problem(level: int, rng: random.Random) -> Problem:
    """One problem of ``level`` (1..:data:`LEVELS`), its numbers and words drawn from ``rng``."""
    if level not in _SHAPES:
        raise ValueError(f"math level {level}: the ladder has levels 1..{LEVELS}")
    start, event_digits, events = _SHAPES[level]
    who = rng.choice(_NAMES)
    words = {"n": who, "p": _PRONOUN[who], "t": rng.choice(_THINGS), "c": rng.choice(_CONTAINERS)}
    steps: list[tuple[str, int, int, int]] = []
    sentences: list[str] = []
    if isinstance(start, tuple):
        a, b = max(2, _number(rng, start[0])), _number(rng, start[1])  # one pack makes no product
        value = a * b
        steps.append(("*", a, b, value))
        sentences.append(rng.choice(_START_PACKS).format(a=a, b=b, **words))
    else:
        value = _number(rng, start)
        sentences.append(rng.choice(_START).format(a=value, **words))
    for _ in range(events):
        b = _number(rng, event_digits)
        op = rng.choice("+-") if level > 1 else "+"
        if op == "-" and b > value:
            op = "+"
        result = value + b if op == "+" else value - b
        steps.append((op, value, b, result))
        sentences.append(rng.choice(_ADD if op == "+" else _TAKE).format(b=b, **words))
        value = result
    sentences.append(
        rng.choice(_QUESTION_PACKS if isinstance(start, tuple) and not events else _QUESTION).format(**words)
    )
    head = f"{steps[0][1]}*{steps[0][2]}" if steps[0][0] == "*" else str(steps[0][1])
    key = f"{level}:{who}:{words['t']}:{head}" + "".join(f"{op}{b}" for op, _, b, _ in steps if op != "*")
    solution = "\n".join(worked_step(*step) for step in steps) + f"\n#### {value}"
    return Problem(key, " ".join(sentences), solution, value, tuple(steps))


def _columns(op: str, a: int, b: int) -> Iterator[tuple[int, int, int, int, int]]:
    """The schoolbook columns of ``a op b``, ones first: (left, right, carry in, value, carry out).
    For ``+`` and ``-`` a column of each operand (a missing digit is 0; a borrow adds ten to the
    left digit); for ``*`` the one-digit ``a`` times each digit of ``b``."""
    carry = 0
    if op == "*":
        for d in map(int, reversed(str(b))):
            value = a * d + carry
            yield a, d, carry, value, value // 10
            carry = value // 10
        return
    da, db = str(a)[::-1], str(b)[::-1]
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        if op == "+":
            value, out = x + y + carry, (x + y + carry) // 10
        else:
            out = int(x - y - carry < 0)
            x += 10 * out
            value = x - y - carry
        yield x, y, carry, value, out
        carry = out


def worked_step(op: str, a: int, b: int, result: int) -> str:
    """One step written the schoolbook way, ones column first, each column a single-digit fact
    with its carry or borrow: ``37 + 45: 7 + 5 = 12, 3 + 4 + 1 = 8, so 37 + 45 = 82``. A model
    then never has to produce a many-digit number in one go (its digits come out most significant
    first, but a carry travels the other way); it copies the columns' results instead. Two single
    digits are one fact: ``3 + 4 = 7``. A product needs a one-digit factor (the ladder's are)."""
    if a < 10 and b < 10:
        return f"{a} {op} {b} = {result}"
    if op == "*":
        if min(a, b) >= 10:
            raise ValueError(f"{a} * {b}: a worked product needs a one-digit factor")
        columns = _columns(op, *sorted((a, b)))
    else:
        columns = _columns(op, a, b)
    carry_op = "-" if op == "-" else "+"
    worked = ", ".join(
        f"{x} {op} {y}" + (f" {carry_op} {c}" if c else "") + f" = {value}" for x, y, c, value, _ in columns
    )
    return f"{a} {op} {b}: {worked}, so {a} {op} {b} = {result}"


def digit_steps(steps: tuple[tuple[str, int, int, int], ...]) -> int:
    """Single-digit operations the schoolbook algorithm takes for ``steps``: a column added or
    subtracted, a digit multiplied, a carry or a borrow each count one."""
    total = 0
    for op, a, b, _ in steps:
        if op == "*":
            small, large = sorted((a, b))
            for m in map(int, str(small)):
                total += sum(1 + (out > 0) for *_, out in _columns("*", m, large))
            total += (len(str(small)) - 1) * len(str(a * b))  # adding the partial products
        else:
            total += sum(1 + out for *_, out in _columns(op, a, b))
    return total

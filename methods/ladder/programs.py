"""The code rungs: small Python functions in MBPP's form (a prompt, assert tests, a reference
solution), composed from primitives on the argument. The level is the composition depth:

====  ==============================================  ===========================================
level shape                                          example reference
====  ==============================================  ===========================================
1     one primitive                                   ``return x + 3``
2     two primitives, one applied to the other        ``return (x + 3) * 2``
3     a conditional choosing between two primitives   ``if x > 5: return x * 2`` / ``return x + 1``
4     a loop with a filter                            ``for x in xs: if x > 3: total += x``
5     a loop with a filter and a primitive            ``for x in xs: if x % 2 == 0: total += x * 3``
6     a loop with two branches, then a primitive      ``... else: total -= x`` / ``return total + 5``
====  ==============================================  ===========================================

The measured difficulty is the reference's size in AST nodes (:func:`ast_nodes`); its mean rises
with every level (``tests/test_ladder.py``). The program's **key** is its reference code, the
function's name included: the same program in another wording is the same task, while ``x + 3``
asked as ``convert`` in training and as ``solve`` in evaluation are two tasks of one skill, as a
sum is in the math rungs (level 1 has a few hundred programs; named, a few thousand).

Tests are three asserts on inputs drawn for the task (for a conditional, on both sides of it);
the prompt shows the first, as MBPP's prompts show theirs. Behind them, a task whose condition
compares with a constant has a test at its boundary for each *boundary mutant* the three let
through (``>`` for ``>=``, the constant one off; ``x % k`` for ``x % (k±1)``: EvalPlus's lesson, that
a few tests pass wrong programs): on the three alone, 89% of level 3's boundary mutants and about
half of levels 4-6's passed every test, so a sampled program off by one at its condition was judged
right — a self-teaching tier picks exactly those out of 16 samples. These extra tests come from a
generator of their own, seeded by the task's key: the tasks, their prompts and first three tests
are what they were. Expected values come from running the
reference, which this module wrote from its own templates (no outside code is executed here).
Every step of a task must matter to its tests: each *mutant* of the reference — steps left out
(all of them, levels 1-2; either of level 2's; level 5's primitive; level 6's final one), a
condition that always or never holds (levels 3-6) — fails at least one of them, or the inputs,
then the program, are drawn again. Without this, 7-20% of the loop levels' tasks were passed by a
program that ignores its filter (``less than 26`` over elements of 1..20), and level 2 asked for
``(x + 6) - 6`` or a string reversed before taking its length.
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["LEVELS", "Program", "ast_nodes", "program"]

LEVELS = 6

_WORDS = ["kite", "apple", "river", "moon", "tiger", "candle", "garden", "pencil", "rocket", "banana"]
_FUNCTION_NAMES = ["compute", "transform", "solve", "process", "calc", "apply_rule", "result_for", "convert"]

# Primitives: (English with {o} for what they act on, code with {v} for the value[, result type]).
# Constants ({k}, {w}, {c}) are drawn per task.
_INT_OPS = [
    ("add {k} to {o}", "{v} + {k}"),
    ("subtract {k} from {o}", "{v} - {k}"),
    ("multiply {o} by {k}", "{v} * {k}"),
    ("divide {o} by {k}, rounding down", "{v} // {k}"),
    ("take the remainder of {o} divided by {k}", "{v} % {k}"),
    ("square {o}", "{v} * {v}"),
]
_STR_OPS = [
    ("turn {o} into upper case", "{v}.upper()", "str"),
    ("reverse {o}", "{v}[::-1]", "str"),
    ("take the length of {o}", "len({v})", "int"),
    ("append '{w}' to {o}", "{v} + '{w}'", "str"),
    ("count the letter '{c}' in {o}", "{v}.count('{c}')", "int"),
    ("take the first letter of {o}", "{v}[0]", "str"),
]
_LIST_OPS = [
    ("add up the elements of {o}", "sum({v})", "int"),
    ("take the largest element of {o}", "max({v})", "int"),
    ("take the smallest element of {o}", "min({v})", "int"),
    ("take the length of {o}", "len({v})", "int"),
    ("take the first element of {o}", "{v}[0]", "int"),
    ("take the last element of {o}", "{v}[-1]", "int"),
]
_CONDITIONS = [  # on an element x
    ("greater than {k}", "{v} > {k}"),
    ("less than {k}", "{v} < {k}"),
    ("even", "{v} % 2 == 0"),
    ("odd", "{v} % 2 == 1"),
    ("divisible by {k}", "{v} % {k} == 0"),
]
_AGGREGATES = [  # level 4: what a loop does with the elements that meet its condition
    ("add up, starting from 0,", "total += x"),
    ("count", "total += 1"),
    ("return a list, in order, of", "total.append(x)"),
]
_ARG = {"int": ("x", "a whole number x"), "str": ("s", "a string s"), "list": ("xs", "a list of whole numbers xs")}

_PROMPTS = [
    "Write a Python function {name}({arg}) that takes {arg_text}. It should {steps}, and return the result.",
    "Define a function {name}({arg}). Given {arg_text}, it must {steps}; the function returns the result.",
    "Create a Python function named {name} with one parameter, {arg_text}. Steps: {steps}. Return the result.",
]


@dataclass(frozen=True)
class Program:
    key: str
    """The level and the reference program (its function's name included)."""
    name: str
    instruction: str
    reference: str
    tests: tuple[str, ...]


def _primitive(rng: random.Random, kind: str, on: str, operand: str, k_max: int = 9) -> tuple[str, str, str]:
    """A primitive for a value of ``kind``: (English acting on ``on``, code acting on ``operand``,
    result kind); its constant ``k`` in 2..``k_max``."""
    consts = {"k": rng.randint(2, k_max), "w": rng.choice(["ab", "xy", "ok", "zz"]), "c": rng.choice("aeiont")}
    if kind == "int":
        text, code = rng.choice(_INT_OPS)
        out = "int"
    else:
        text, code, out = rng.choice(_STR_OPS if kind == "str" else _LIST_OPS)
    return text.format(o=on, **consts), code.format(v=operand, **consts), out


def _wrap(code: str) -> str:
    """``code`` as an operand: parenthesised unless it is a name, a call, a subscript or a constant."""
    node = ast.parse(code, mode="eval").body
    return code if isinstance(node, ast.Name | ast.Call | ast.Subscript | ast.Constant) else f"({code})"


def _draw(arg_type: str) -> Callable[[random.Random], list]:
    def draw(rng: random.Random) -> list:
        if arg_type == "int":
            return [rng.randint(0, 40) for _ in range(3)]
        if arg_type == "str":
            return rng.sample(_WORDS, 3)
        return [[rng.randint(1, 20) for _ in range(rng.randint(3, 6))] for _ in range(3)]

    return draw


def _body(level: int, rng: random.Random) -> tuple[str, str, str, Callable[[random.Random], list], list[str]]:
    """(argument type, English steps, the function's body, a draw of three test inputs, the
    body's mutants: a step left out, a condition that always or never holds) of a ``level``
    program."""
    if level in (1, 2):
        arg_type = rng.choice(["int", "str", "list"])
        arg = _ARG[arg_type][0]
        texts, codes, kind = [], [arg], arg_type
        for i in range(level):
            on = arg if i == 0 else "the result"
            text, code, kind = _primitive(rng, kind, on, _wrap(codes[-1]), k_max=30 if level == 1 else 9)
            texts.append(text)
            codes.append(code)
        mutants = [f"    return {arg}"]  # every step left out: (x + 6) - 6 is x
        if level == 2:  # the second step left out; the first (the second on the argument itself)
            mutants += [f"    return {codes[1]}", f"    return {codes[2].replace(_wrap(codes[1]), arg)}"]
        return arg_type, ", then ".join(texts), f"    return {codes[-1]}", _draw(arg_type), mutants
    if level == 3:
        k = rng.randint(5, 30)
        t1, c1, _ = _primitive(rng, "int", "x", "x")
        t2, c2, _ = _primitive(rng, "int", "x", "x")
        while c2 == c1:
            t2, c2, _ = _primitive(rng, "int", "x", "x")
        steps = f"if x is greater than {k}, {t1}; otherwise {t2}"
        body = f"    if x > {k}:\n        return {c1}\n    return {c2}"

        def both_sides(r: random.Random) -> list:
            return [r.randint(0, k), r.randint(k + 1, k + 20), r.randint(0, k + 20)]

        return "int", steps, body, both_sides, [f"    return {c1}", f"    return {c2}"]
    if level not in (4, 5, 6):
        raise ValueError(f"code level {level}: the ladder has levels 1..{LEVELS}")
    # Loops over a list: a running total from 0 over the elements x that meet a condition.
    cond_text, cond = rng.choice(_CONDITIONS)
    k = rng.randint(2, 9) if "divisible" in cond_text else rng.randint(3, 30)
    cond_text, cond = cond_text.format(k=k), cond.format(v="x", k=k)
    loop = "    total = 0\n    for x in xs:\n"
    mutants = []
    if level == 4:
        what, update = rng.choice(_AGGREGATES)
        steps = f"{what} the elements that are {cond_text}"
        body = f"{loop}        if {cond}:\n            {update}\n    return total"
        if update.startswith("total.append"):
            body = body.replace("total = 0", "total = []").replace("total", "found")
    elif level == 5:
        t1, c1, _ = _primitive(rng, "int", "x", "x")
        steps = f"for each element x that is {cond_text}, {t1} and add the result to a total that starts at 0"
        body = f"{loop}        if {cond}:\n            total += {c1}\n    return total"
        mutants.append(body.replace(f"total += {c1}", "total += x"))
    else:
        t2, c2, _ = _primitive(rng, "int", "the total", "total")
        steps = (
            f"start a total at 0; for each element x, add x to the total if x is {cond_text}, and otherwise "
            f"subtract x from it; finally {t2}"
        )
        body = (
            f"{loop}        if {cond}:\n            total += x\n        else:\n            total -= x\n    return {c2}"
        )
        mutants.append(body.replace(f"return {c2}", "return total"))
    mutants += [body.replace(f"if {cond}:", "if True:"), body.replace(f"if {cond}:", "if False:")]
    return "list", steps, body, _draw("list"), mutants


_SAFE_BUILTINS = {"len": len, "max": max, "min": min, "sum": sum}
_DRAWS = 20
"""Test inputs, then whole programs, are drawn again (up to this many times each) until the three
expected values differ and every mutant fails a test."""


def _function(source: str, name: str) -> Callable:
    namespace: dict = {}
    exec(compile(source, "<ladder>", "exec"), {"__builtins__": _SAFE_BUILTINS}, namespace)  # own template
    return namespace[name]


def _fails(mutant: Callable, inputs: list, expected: list) -> bool:
    """Whether ``mutant`` gets at least one of the tests wrong (an exception counts as wrong)."""
    for value, want in zip(inputs, expected, strict=True):
        try:
            if mutant(value) != want:
                return True
        except Exception:  # a step left out can leave a type the next one does not take
            return True
    return False


_BOUNDARY = re.compile(r"x (>|<|%) (\d+)")


def _boundary_mutants(reference: str) -> list[str]:
    """``reference`` with its comparison's boundary moved: ``x > k`` as ``x >= k`` and ``x > k±1``
    (``<`` alike), ``x % k`` as ``x % (k±1)`` (a condition's or a remainder step's); none where no
    step compares with or divides by a constant."""
    m = _BOUNDARY.search(reference)
    if m is None:
        return []
    op, k = m.group(1), int(m.group(2))
    if op == "%" and k == 2:  # even / odd: no boundary (x % 1 always holds, x % 3 is another condition)
        others = [f"x % {k + 1}"]
    elif op == "%":
        others = [f"x % {k - 1}", f"x % {k + 1}"]
    else:
        others = [f"x {op}= {k}", f"x {op} {k - 1}", f"x {op} {k + 1}"]
    return [reference[: m.start()] + o + reference[m.end() :] for o in others]


def _boundary_tests(name: str, reference: str, key: str, arg_type: str, inputs: list) -> list:
    """Inputs at ``reference``'s boundary, one for each boundary mutant the ``inputs`` do not
    fail, drawn by a generator seeded with ``key`` (see the module's text)."""
    mutants = [_function(m, name) for m in _boundary_mutants(reference)]
    function = _function(reference, name)
    expected = [function(v) for v in inputs]
    left = [m for m in mutants if not _fails(m, inputs, expected)]
    if not left:
        return []
    k = int(_BOUNDARY.search(reference).group(2))
    rng = random.Random(hashlib.sha256(f"kibidango/ladder/boundary/v1:{key}".encode()).digest())
    near = [v for v in (k - 1, k, k + 1, 2 * k - 2, 2 * k, 2 * k + 2, 3 * k) if v >= 0]
    extra: list = []
    for mutant in left:
        if any(_fails(mutant, [e], [function(e)]) for e in extra):
            continue
        tries = [v for v in near for _ in range(4 if arg_type == "list" else 1)]
        for v in tries:  # the boundary first; in a list, beside other drawn elements
            if arg_type == "list":
                value = _draw("list")(rng)[0]
                value.insert(rng.randrange(len(value) + 1), v)
            else:
                value = v
            if _fails(mutant, [value], [function(value)]):
                extra.append(value)
                break
    return extra


def program(level: int, rng: random.Random) -> Program:
    """One program of ``level`` (1..:data:`LEVELS`), its constants, inputs and words from ``rng``.
    A program whose three test inputs give three different results, and on which every mutant of
    it fails a test, within :data:`_DRAWS` draws is kept; one that cannot (``x % 2`` has two
    results; a filter no element 1..20 fails) is drawn again, so no constant and no program that
    skips a step passes."""
    if not 1 <= level <= LEVELS:
        raise ValueError(f"code level {level}: the ladder has levels 1..{LEVELS}")
    for _ in range(_DRAWS):
        arg_type, steps, body, draw, mutant_bodies = _body(level, rng)
        name = rng.choice(_FUNCTION_NAMES)
        arg, arg_text = _ARG[arg_type]
        reference = f"def {name}({arg}):\n{body}\n"
        function = _function(reference, name)
        mutants = [_function(f"def {name}({arg}):\n{m}\n", name) for m in mutant_bodies]
        for _ in range(_DRAWS):
            inputs = draw(rng)
            expected = [function(value) for value in inputs]
            if len({repr(e) for e in expected}) == len(expected) and all(_fails(m, inputs, expected) for m in mutants):
                key = f"{level}:{reference}"
                inputs = inputs + _boundary_tests(name, reference, key, arg_type, inputs)
                tests = tuple(f"assert {name}({v!r}) == {function(v)!r}" for v in inputs)
                prompt = rng.choice(_PROMPTS).format(name=name, arg=arg, arg_text=arg_text, steps=steps)
                return Program(key, name, prompt, reference, tests)
    raise RuntimeError(
        f"code level {level}: no program with three distinct test results that fail its mutants in {_DRAWS} draws"
    )


def ast_nodes(code: str) -> int:
    """The size of ``code``'s syntax tree: the measured difficulty of a code task."""
    return sum(1 for _ in ast.walk(ast.parse(code)))

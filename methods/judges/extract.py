"""The program in a model's answer, as robustly as EvalPlus's sanitizer finds it.

A small model wraps its code in every way: a fenced block (closed, or left open at the end of its
tokens), prose before or after, a closing fence with nothing before it, test calls and prints
after the function, a body that completes a signature it was given. The judge should learn
whether the answer solves the task, not whether its fences were tidy, so :func:`extract_program`:

1. takes the candidates: each fenced block (```` ```python ```` or a bare fence, closed or not),
   then the whole answer with fence lines dropped;
2. in each, keeps the longest run of lines that parses as Python (EvalPlus's ``code_extract``:
   prose before or after falls away), preferring a run that defines the entry point;
3. drops the answer's own checks of itself — top-level ``assert`` statements, ``print`` calls
   (and loops or branches that only print or assert), ``if __name__ == "__main__":`` blocks — which
   would crash or clutter a right function's run; the rest of the program runs as written.

:func:`format_failure` says when nothing runnable is left (no code, or code that does not parse):
a failure of the answer's format, which stage 1B counts apart from wrong answers.
"""

from __future__ import annotations

import ast
import re
import threading

__all__ = ["extract_program", "format_failure", "parse"]

_AST_LOCK = threading.Lock()


def parse(source: str) -> ast.Module:
    """``ast.parse``, one thread at a time. CPython 3.11 keeps the AST constructor's recursion depth
    in state its threads share, and parses on concurrent threads raised ``SystemError: AST
    constructor recursion depth mismatch`` (python/cpython#106905): a small study's 1S evaluation,
    judging 16 answers at once, failed on it after 70 minutes."""
    with _AST_LOCK:
        return ast.parse(source)


_FENCE = re.compile(r"^\s*```")
_MAX_LINES = 400  # the longest-parsing-run search is quadratic in the lines it tries
_MAX_PARSES = 2000  # and stops after this many tries (a long answer of prose)


def extract_program(answer: str, entry_points: tuple[str, ...] = (), prompt: str = "") -> str:
    """The answer's program (see the module); the answer itself when nothing in it parses.
    ``entry_points``: the names the task calls; ``prompt``: a signature (HumanEval's) that an
    answer defining none of them completes with a body."""
    candidates = _fenced(answer) + [_unfenced(answer)]
    program = _best(candidates, entry_points)
    if prompt and entry_points and (program is None or not _defines(program, entry_points)):
        completed = _best([prompt + body for body in candidates], entry_points, prefer_fenced=False)
        if completed is not None and _defines(completed, entry_points):
            program = completed
    return answer if program is None else _sanitize(program)


def _best(candidates: list[str], entry_points: tuple[str, ...], prefer_fenced: bool = True) -> str | None:
    """The longest parsing run of the candidate that defines an entry point (a fenced one first,
    with ``prefer_fenced``; the unfenced text is the last candidate)."""
    best: tuple[int, str] | None = None
    for i, text in enumerate(candidates):
        code = _longest_parsing_run(text)
        if not code.strip():
            continue
        fenced = prefer_fenced and i < len(candidates) - 1
        score = (2 if _defines(code, entry_points) else 0) + (1 if fenced else 0)
        if best is None or score > best[0] or (score == best[0] and len(code) > len(best[1])):
            best = (score, code)
    return None if best is None else best[1]


def format_failure(program: str) -> str | None:
    """Why ``program`` (an :func:`extract_program` result) cannot be run as the answer's code, or
    None: empty, or not Python."""
    if not program.strip():
        return "the answer holds no code"
    try:
        parse(program)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        return f"the answer's code does not parse ({type(e).__name__})"
    return None


def _fenced(answer: str) -> list[str]:
    """Every fenced block's body: from a fence line to the next fence line, or to the end."""
    blocks, current = [], None
    for line in answer.split("\n"):
        if _FENCE.match(line):
            if current is None:
                current = []
            else:
                blocks.append("\n".join(current))
                current = None
        elif current is not None:
            current.append(line)
    if current:
        blocks.append("\n".join(current))
    return blocks


def _unfenced(answer: str) -> str:
    return "\n".join(line for line in answer.split("\n") if not _FENCE.match(line))


def _parses(code: str) -> bool:
    try:
        parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return True


def _longest_parsing_run(text: str) -> str:
    """The longest run of whole lines of ``text`` that parses (the text itself when it does)."""
    if _parses(text):
        return text
    lines = text.split("\n")[:_MAX_LINES]
    best, tries = "", 0
    for i in range(len(lines)):
        if not lines[i].strip() or lines[i][0] in " \t":  # a run starts at a top-level line
            continue
        for j in range(len(lines), i, -1):
            code = "\n".join(lines[i:j])
            if len(code) <= len(best) or tries >= _MAX_PARSES:
                break
            tries += 1
            if _parses(code):
                best = code
                break
    return best


def _defines(code: str, names: tuple[str, ...]) -> bool:
    try:
        tree = parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    kinds = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
    return any(isinstance(n, kinds) and n.name in names for n in tree.body)


def _sanitize(code: str) -> str:
    """``code`` without its top-level self-checks (see the module), each kept statement as its own
    source lines (comments inside them included)."""
    try:
        tree = parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return code
    kept = [n for n in tree.body if not _self_check(n)]
    if len(kept) == len(tree.body) or not kept:
        return code
    lines = code.split("\n")
    return "\n".join("\n".join(lines[_first_line(n) - 1 : n.end_lineno]) for n in kept) + "\n"


def _self_check(node: ast.stmt) -> bool:
    """An answer's check of itself: an assert, a print, a main guard, or a block of only those."""
    if isinstance(node, ast.Assert):
        return True
    if isinstance(node, ast.Expr):
        return _calls_print(node)
    if isinstance(node, ast.If) and _main_guard(node.test):
        return True
    if isinstance(node, ast.For | ast.While | ast.If | ast.With | ast.Try):
        body = [s for part in ("body", "orelse", "finalbody") for s in getattr(node, part, [])]
        return bool(body) and all(_self_check(s) for s in body)
    return False


def _main_guard(test: ast.expr) -> bool:
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators)
    )


def _calls_print(node: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "print" for n in ast.walk(node)
    )


def _first_line(node: ast.stmt) -> int:
    """A definition's first line, its decorators included."""
    decorators = getattr(node, "decorator_list", [])
    return min([node.lineno, *(d.lineno for d in decorators)])

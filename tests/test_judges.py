"""Judges: known right and wrong answers for each kind, and hostile programs the code judge must
contain and report."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from methods.judges import Task, make_judge
from methods.judges.math import final_number


def test_math_judge_reads_the_final_number_whatever_its_format():
    judge = make_judge("math")
    task = Task("gsm-1", "How many?", reference="She has 3 + 4 = 7 boxes, so 7 * 250 = 1750.\n#### 1750")
    for right in (
        "The answer is 1,750.",
        "#### 1750",
        "So she pays $1750.00 in total",
        "1750.0 dollars",
        "answer is: 1750",
    ):
        assert judge(task, right).passed, right
    for wrong in ("The answer is 1,705.", "#### 175", "no idea", "It is 1750 or maybe 1751"):
        verdict = judge(task, wrong)
        assert not verdict.passed and verdict.outcome == "failed", wrong
    assert final_number("half: 1/2") == final_number("0.5")
    assert make_judge("math")(Task("x", "?", reference="no number here"), "3").outcome == "judge_error"


def test_reference_judge_scores_against_the_gold_answer():
    judge = make_judge("reference", threshold=0.5)
    task = Task("g-1", "Name the primary colours.", reference="The primary colours are red, yellow and blue.")
    good = judge(task, "The primary colours are red, blue and yellow.")
    bad = judge(task, "Photosynthesis turns light into sugar.")
    assert good.passed and good.score > 0.5 and not bad.passed and bad.score < good.score
    assert make_judge("reference")(Task("g-2", "?"), "anything").outcome == "judge_error"


MBPP = Task(
    "mbpp-1", "Write add(a, b).", tests=("assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 0) == 1")
)


@pytest.fixture(scope="module")
def code():
    return make_judge("code", wall_seconds=8, cpu_seconds=3, memory_mb=512)


def test_code_judge_counts_the_asserts_a_program_passes(code):
    some = code(MBPP, "```python\ndef add(a, b):\n    return a + b\n```")
    assert not some.passed and some.outcome == "failed" and some.score == pytest.approx(2 / 3)
    assert "2/3 tests passed" in some.reason and "AssertionError" in some.reason
    good = code(Task("mbpp-2", "Write add.", tests=MBPP.tests[:2]), "def add(a, b):\n    return a + b\n")
    assert good.passed and good.outcome == "passed" and good.score == 1.0
    crash = code(MBPP, "def add(a, b):\n    return a +\n")
    assert crash.outcome == "error" and "SyntaxError" in crash.reason


def test_code_judge_runs_humaneval_check_functions(code):
    task = Task(
        "he-0",
        'def inc(x):\n    """Return x + 1."""\n',
        tests=("def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(-1) == 0\n",),
        entry_point="inc",
    )
    assert code(task, "    return x + 1\n").passed  # a completion of the prompt's signature
    assert code(task, "def inc(x):\n    return x + 1\n").passed
    assert code(task, "    return x\n").outcome == "failed"


def test_hostile_programs_are_contained_and_reported(code, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-proj-SANDBOXplanted0123456789abcdef")
    outside = tmp_path / "escaped.txt"
    cases = {
        "infinite loop": ("while True:\n    pass\n", "timeout", "limit was reached"),
        "sleeping forever": ("import time\ntime.sleep(3600)\n", "timeout", "wall limit"),
        "fork bomb": ("import os\nwhile True:\n    os.fork()\n", "error", "os.fork is not allowed"),
        "subprocess": ("import subprocess\nsubprocess.run(['true'])\n", "error", "not allowed"),
        "10 GB allocation": ("x = bytearray(10 * 1024 ** 3)\n", "error", "MemoryError"),
        "write outside": (f"open({str(outside)!r}, 'w').write('x')\n", "error", "writing outside the sandbox"),
        "network": (
            "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)\n",
            "error",
            "socket.connect is not allowed",
        ),
        "ctypes": ("import ctypes\nctypes.CDLL(None).system(b'touch /tmp/kb-ctypes')\n", "error", "not allowed"),
    }
    for name, (program, outcome, reason) in cases.items():
        started = time.monotonic()
        verdict = code(MBPP, program)
        assert verdict.outcome == outcome and reason in verdict.reason, (name, verdict)
        assert not verdict.passed and time.monotonic() - started < 60, name
    assert not outside.exists() and not Path("/tmp/kb-ctypes").exists()
    secret = code(Task("env", "?", tests=("assert 'OPENAI_API_KEY' not in __import__('os').environ",)), "x = 1\n")
    assert secret.passed  # the program's environment is empty
    flood = code(MBPP, "print('y' * 50_000_000)\n")
    assert flood.outcome == "error" and not flood.passed  # stdout is capped by the file-size limit


def test_a_fork_bomb_leaves_no_process_behind(code):
    """Even with the audit hook out of the way (os.fork is refused by the hook first), the process
    group is killed and the process limit holds."""
    program = "import sys\nsys.addaudithook = None\nimport os\nfor _ in range(10):\n    os.fork()\n"
    before = _python_processes()
    code(MBPP, program)
    time.sleep(0.5)
    assert _python_processes() <= before


def _python_processes() -> int:
    count = 0
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"guard.py" in (entry / "cmdline").read_bytes():
                count += 1
        except OSError:
            continue
    return count


def test_the_sandbox_says_how_it_isolates(code):
    verdict = code(MBPP, "def add(a, b):\n    return a + b\n")
    iso = verdict.details["isolation"]
    assert set(iso) == {"network_namespace", "user_nobody", "python"}
    if os.geteuid() == 0 and iso["network_namespace"]:
        assert iso["user_nobody"]

"""Judges: known right and wrong answers for each kind, and hostile programs the code judge must
contain and report."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from methods.judges import Task, make_judge
from methods.judges.math import final_number
from tests.conftest import OPENAI_KEY_ENV


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


# ---- llm judge: against a real OpenAI-compatible server on 127.0.0.1 ----------------------------


def test_llm_verdict_parsing_never_passes_what_it_cannot_read():
    from methods.judges.llm import parse_verdict

    assert parse_verdict('{"passed": true, "score": 0.9, "reason": "right"}') == {
        "passed": True,
        "score": 0.9,
        "reason": "right",
    }
    assert parse_verdict('```json\n{"passed": false, "score": 0, "reason": "wrong"}\n```')["passed"] is False
    for bad, why in (
        ("Sure! The answer looks right.", "not JSON"),
        ('["passed"]', "not an object"),
        ('{"passed": "yes", "score": 1, "reason": "r"}', "boolean"),
        ('{"passed": true, "score": 7, "reason": "r"}', "score"),
        ('{"passed": true, "score": true, "reason": "r"}', "score"),
        ('{"passed": true, "score": 1}', "reason"),
        ("", "empty"),
    ):
        assert why in parse_verdict(bad)["error"], bad
    assert "refused" in parse_verdict(None, refusal="I can't help with that")["error"]
    assert "cut" in parse_verdict('{"passed": true, "score": 1, "reason": "r"}', finish_reason="length")["error"]


def test_llm_judge_against_a_real_openai_compatible_server(openai_server, monkeypatch):
    import httpx

    from methods.judges.llm import LLMJudge, parse_verdict

    base, key = openai_server
    monkeypatch.setenv(OPENAI_KEY_ENV, key)
    task = Task("g-1", "What colour is the sky?", reference="Blue.")
    judge = make_judge(
        "llm", base_url=base, model="stories260K", api_key_env=OPENAI_KEY_ENV, response_format="json_object"
    )
    verdict = judge(task, "The sky is blue.")
    # The server's own reply to the same request, read without the openai client: the judge's
    # verdict is exactly what parsing that reply gives (a tiny story model's verdict quality is
    # beside the point; greedy decoding makes the reply repeatable).
    raw = httpx.post(
        base + "/chat/completions",
        json=judge._request(task, "The sky is blue."),
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    ).json()
    choice = raw["choices"][0]
    expected = parse_verdict(choice["message"]["content"], None, choice["finish_reason"])
    if "error" in expected:
        assert verdict.outcome == "judge_error" and not verdict.passed and verdict.reason == expected["error"]
    else:
        assert (verdict.passed, verdict.score) == (expected["passed"], expected["score"])
    assert verdict.details["prompt_tokens"] == raw["usage"]["prompt_tokens"] > 0
    assert verdict.cost > 0 and key not in repr(verdict)

    # No structured output asked for: the story model writes a story, cut at max_tokens.
    free = LLMJudge(base, "stories260K", OPENAI_KEY_ENV, response_format="none", max_tokens=16)
    assert free(task, "Blue.").outcome == "judge_error"

    # An endpoint that rejects the request shape (llama-cpp-python knows no json_schema format).
    strict = LLMJudge(base, "stories260K", OPENAI_KEY_ENV, response_format="json_schema", max_retries=0)
    assert strict(task, "Blue.").outcome == "judge_error"


def test_llm_judge_errors_name_the_variable_never_the_key(openai_server, monkeypatch):
    from core.contract import KibidangoError
    from methods.judges.llm import JudgeConfigError, LLMJudge

    base, key = openai_server
    monkeypatch.delenv(OPENAI_KEY_ENV, raising=False)
    with pytest.raises(KibidangoError, match=OPENAI_KEY_ENV):
        LLMJudge(base, "stories260K", OPENAI_KEY_ENV)
    wrong = "sk-" + "x" * 40
    monkeypatch.setenv(OPENAI_KEY_ENV, wrong)
    with pytest.raises(JudgeConfigError, match="401") as err:
        LLMJudge(base, "stories260K", OPENAI_KEY_ENV, response_format="json_object")(Task("t", "?"), "a")
    assert wrong not in str(err.value) and key not in str(err.value) and OPENAI_KEY_ENV in str(err.value)

    # An endpoint that does not answer: a retryable judge_error, never a pass.
    monkeypatch.setenv(OPENAI_KEY_ENV, key)
    gone = LLMJudge("http://127.0.0.1:9/v1", "m", OPENAI_KEY_ENV, max_retries=0, timeout_s=2)
    verdict = gone(Task("t", "?"), "a")
    assert verdict.outcome == "judge_error" and verdict.details["retryable"] and not verdict.passed

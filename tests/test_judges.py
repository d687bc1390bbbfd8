"""Judges: known right and wrong answers for each kind, and hostile programs the code judge must
contain and report."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from eval.shared_data import SHARED
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


def test_math_judge_fails_a_list_of_guesses_whichever_comes_last():
    """A self-taught sample of stage 1D (small, bb882cc) passed by listing seven final numbers, the
    reference's last: several different marked final numbers fail; one repeated passes."""
    judge = make_judge("math")
    task = Task("ladder-math-5", "?", reference="21 + 8 = 29\n#### 29")
    guesses = judge(task, "21 + 26 = 38\n#### 38\n#### 21\n#### 22\n#### 25\n#### 26\n#### 24\n#### 29")
    assert not guesses.passed and guesses.outcome == "failed" and "7 different final numbers" in guesses.reason
    assert judge(task, "#### 29\n#### 29").passed
    assert not judge(task, "The answer is 28. No, the answer is 29.").passed


def test_math_judge_with_working_fails_a_right_number_reached_by_wrong_arithmetic():
    """`working: true`: an equation between plain numbers that does not hold fails the answer,
    whatever its final number (five of the 28 self-taught math pairs of that 1D taught such sums);
    chained, bracketed, partly worked and divided equations are not read; the ladder's and GSM8K's
    worked solutions pass (GSM8K's test split: one flag, a slip of the dataset's own)."""
    from methods.judges.math import wrong_working
    from methods.ladder import ladder_rows

    strict, plain = make_judge({"kind": "math", "working": True}), make_judge("math")
    task = Task("ladder-math-5", "?", reference="#### 58")
    verdict = strict(task, "41 + 57 = 58\n#### 58")
    assert not verdict.passed and verdict.outcome == "failed" and "41 + 57 = 58" in verdict.reason
    assert plain(task, "41 + 57 = 58\n#### 58").passed  # GSM8K's own scoring: the final number only
    assert strict(task, "41 + 17 = 58\n#### 58").passed
    assert wrong_working("If 38 + 51 = 69, then 38 + 51 = 89") == ["38 + 51 = 69"]
    assert wrong_working("7 + 9 + 1 = 18, so 1,000 + 2,000 = 3,000 and 5 x 3 = 15") == ["7 + 9 + 1 = 18"]
    for unread in (
        "3 * 7 + 2 = 23",
        "(3 + 4) = 8",
        "4080 + 4080 / 2 = 4000 + 2040",
        "3 / 2 = 1 1/2",
        "17 / 3 = 5",
        "20% of 50 = 10",
        "50 - 20 = 30%",
        "$350 000 + $5 = $9",
        "x2 + 3 = 6",
    ):
        assert wrong_working(unread) == [], unread
    for level in range(1, 8):
        for row in ladder_rows("math", [level], "mining", 40, 0):
            assert strict(row["task"], row["task"].reference).passed, row["task"].reference
    gsm8k = SHARED / "data" / "gsm8k" / "test.jsonl"
    if gsm8k.is_file():
        solutions = [json.loads(line)["answer"] for line in gsm8k.open()]
        assert [w for s in solutions if (w := wrong_working(s))] == [["$32 - $20 = $300"]]


def test_underived_working_is_a_copied_number():
    """For an answer written with the final number shown (1D's hinted self tier): the number must be
    the last result of a chain of equations from the question's numbers; a column sum's digit steps
    are read as the working of a step; every ladder reference derives its number."""
    from methods.judges.math import underived
    from methods.ladder import ladder_rows

    q = "Ivy had 66 cookies. Then she gets 69 more. Ivy loses 98 cookies. How many are there now?"
    assert underived(q, "66 + 69 = 135\n135 - 98 = 37\n#### 37") is None
    assert underived(q, "66 + 69: 6 + 9 = 15, 6 + 6 + 1 = 13, so 66 + 69 = 135\n135 - 98 = 37\n#### 37") is None
    assert underived(q, "4 * 5 = 20\n#### 37") == "no step combines the question's numbers"
    assert underived(q, "#### 37") == "no step combines the question's numbers"
    assert "not the last step's result 135" in underived(q, "66 + 69 = 135\n#### 37")
    assert "not the last step's result 164" in underived(q, "66 + 98 = 164, 20 + 17 = 37\n#### 37")
    for level in range(1, 8):
        for row in ladder_rows("math", [level], "mining", 20, 0):
            assert underived(row["task"].prompt, row["task"].reference) is None, row["task"].reference


def test_an_answer_ends_at_its_last_mark():
    from methods.judges.math import through_mark

    assert through_mark("8 + 4 = 12\n#### 12 ≠ 4 Spaces") == "8 + 4 = 12\n#### 12"
    assert through_mark("#### 1,200.50 dollars\nThanks!") == "#### 1,200.50"
    assert through_mark("12 - 5 = 7\n#### 7") == "12 - 5 = 7\n#### 7"
    assert through_mark("the answer is 7, I think") == "the answer is 7, I think"  # no #### mark: as it is


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
    from methods.judges.code import isolation

    if isolation()["kind"] != "bubblewrap":
        pytest.skip("needs bubblewrap (apt-get install bubblewrap; make setup installs it as root)")
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
        "write outside": (f"open({str(outside)!r}, 'w').write('x')\n", "error", "Error"),
        "network": (
            "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)\n",
            "error",
            "socket.connect is not allowed",
        ),
        "ctypes": ("import ctypes\nctypes.CDLL(None).system(b'touch /tmp/kb-ctypes')\n", "error", "not allowed"),
        "exit before the tests": ("import os\nos._exit(0)\n", "error", "ended before its tests ran"),
        "exit inside a test": (
            "def add(a, b):\n    import os\n    os._exit(0)\n",
            "error",
            "ended while its tests ran",
        ),
    }
    for name, (program, outcome, reason) in cases.items():
        started = time.monotonic()
        verdict = code(MBPP, program)
        assert verdict.outcome == outcome and reason in verdict.reason, (name, verdict)
        assert not verdict.passed and time.monotonic() - started < 60, name
    assert not outside.exists() and not Path("/tmp/kb-ctypes").exists()
    secret = code(Task("env", "?", tests=("assert 'OPENAI_API_KEY' not in __import__('os').environ",)), "x = 1\n")
    assert secret.passed  # the tester's environment is empty, and so is the candidate's:
    env = code(
        Task("env2", "?", tests=("assert seen == []",)), "import os\nseen = [k for k in os.environ if 'KEY' in k]\n"
    )
    assert env.passed, env
    flood = code(MBPP, "print('y' * 50_000_000)\n")
    assert flood.outcome == "error" and not flood.passed  # stdout is capped by the file-size limit


def test_values_cross_as_plain_data_so_a_rigged_object_passes_nothing(code):
    rigged = "class Always:\n    def __eq__(self, other):\n        return True\n\ndef add(a, b):\n    return Always()\n"
    verdict = code(MBPP, rigged)  # the object stays in the sandbox; the tests hold a handle, equal only to itself
    assert verdict.outcome == "failed" and verdict.score == 0 and "AssertionError" in verdict.reason
    shadow = "def abs(x):\n    return 0\n\ndef add(a, b):\n    return 99\n"  # would make abs(add(..) - 3) < 1 true
    task = Task("shadow", "?", tests=("assert abs(add(1, 2) - 3) < 1",))
    assert code(task, shadow).outcome == "failed"
    # ... unless the task asks for that name (MBPP 126 asks for `sum`): its reference defines it
    asked = Task("sum", "?", reference="def sum(a, b):\n    return a + b\n", tests=("assert sum(1, 2) == 3",))
    assert code(asked, "def sum(a, b):\n    return a + b\n").passed
    # objects of the program's classes, built by the tests or the task's setup, cross as handles
    pairs = Task(
        "pairs",
        "?",
        tests=(
            "assert longest([Pair(1, 2), Pair(3, 4)]) == 2",
            "assert longest([root]) == 1",
            "assert width(int) == 3",
        ),
        setup="root = Pair(0, 9)\n",
    )
    program = (
        "class Pair:\n    def __init__(self, a, b):\n        self.a, self.b = a, b\n"
        "def longest(ps):\n    return len([p for p in ps if isinstance(p, Pair)])\n"
        "def width(t):\n    return len(str(t(123)))\n"
    )
    assert code(pairs, program).passed
    kinds = (
        "import math\n"
        "def f(x):\n"
        "    return [x, (x,), {x}, frozenset([x]), {x: [x]}, b'x', bytearray(b'y'), 1.5, float('inf'), 2 ** 200,\n"
        "            range(3), 1 + 2j, None, True, 'é']\n"
        "def g():\n"
        "    return (i for i in range(3))\n"
        "def h():\n"
        "    raise ValueError('no')\n"
    )
    tests = (
        "assert f(1) == [1, (1,), {1}, frozenset([1]), {1: [1]}, b'x', bytearray(b'y'), 1.5, math.inf, 2 ** 200,"
        " range(3), 1 + 2j, None, True, 'é']",
        "assert list(g()) == [0, 1, 2] and g() != [0, 1, 2]",
        "try:\n    h()\nexcept ValueError as e:\n    assert str(e) == 'no'\nelse:\n    raise AssertionError",
        "assert math.isclose(f(2)[7], 1.5)",  # the program's `import math`, seen by the tests
    )
    verdict = code(Task("kinds", "?", tests=tests), kinds)
    assert verdict.passed, verdict


def test_a_forged_verdict_is_never_a_pass(code):
    """The old sandbox trusted a result line with a nonce the program could read. Now the count
    is the tester's, on a channel the program has no handle on: whatever the program prints or
    writes onto its own reply pipe, it passes only the tests its functions pass."""
    forge = (
        "import json, os, sys\n"
        "line = json.dumps({'passed': 3, 'total': 3, 'errors': []})\n"
        "print(line)\n"
        "for fd in range(1, 20):\n"
        "    try:\n"
        "        os.write(fd, (line + '\\n').encode())\n"
        "    except OSError:\n"
        "        pass\n"
        "os._exit(0)\n"
    )
    verdict = code(MBPP, forge)
    assert not verdict.passed and verdict.outcome == "error", verdict
    # the reply pipe gets '{}' and then junk: an unreadable reply is an error, never an exception
    for junk in ("{}", "[]", "not json", '{"ok": {"x": 1}}'):
        program = (
            f"import os, sys\ndef add(a, b):\n    os.write(int(sys.argv[2]), {junk!r}.encode() + b'\\n')\n    "
            "return a + b\n"
        )
        verdict = code(MBPP, program)
        assert not verdict.passed and verdict.outcome in ("error", "failed"), (junk, verdict)


def test_the_program_cannot_choose_the_names_the_tests_run_with(code):
    """The harness's helpers are reachable from the program (``import __main__``: the candidate's
    script, :mod:`methods.judges.sandbox.candidate`; its write pipe is ``sys.argv[2]``), so it can send a
    "ready" message of its own. Whatever it says, the tests' namespace is built from the task: a
    name is bound only where the tests use it, never a dunder (``__builtins__``: the tests would run
    with the program's ``all``), never a builtin the task does not define, and a module only under
    its own name or the one the task's own code imports it as."""
    forge = (
        "import __main__ as m, sys\n"
        "_real = m.send\n"
        "def _quiet(fd, obj):\n"
        "    if 'ready' not in obj:\n"
        "        _real(fd, obj)\n"
        "m.send = _quiet\n"
        "_real(int(sys.argv[2]), {'ready': {'callables': ['add', 'all', 'isinstance'], 'values': {{VALUES}},"
        " 'modules': {'math': 'cmath', 'json': 'json'}}})\n"
        "def add(a, b):\n"
        "    return -1\n"
    )
    builtins_bool = "'__builtins__': {'d': [['all', {'type': 'bool'}], ['abs', {'type': 'bool'}]]}"
    cases = [
        (builtins_bool, "assert all(x == 3 for x in [add(1, 2)])"),
        ("'all': {'type': 'bool'}", "assert all(x == 3 for x in [add(1, 2)])"),
        ("'expected': {'i': '-1'}", "expected = 3\nassert add(1, 2) == expected"),
        ("", "assert math.floor(add(1, 2)) == 3 or math.pi == 0"),  # 'math' -> cmath is not bound
    ]
    for values, test in cases:
        task = Task("forge", "?", reference="import math\n", tests=(test,))
        verdict = code(task, forge.replace("{VALUES}", values))
        assert not verdict.passed and verdict.outcome in ("failed", "error"), (values, test, verdict)
    # the same task passes a right program: the names it uses are bound from the task and the program
    right = "import math\ndef add(a, b):\n    return a + b\n"
    assert code(Task("ok", "?", reference="import math\n", tests=("assert math.floor(add(1, 2)) == 3",)), right).passed
    # a malformed "ready" is the program's fault (an error), never the judge's (no verdict)
    for bad in ("'x'", "{'callables': 5, 'values': {}}", "{'callables': [], 'values': []}"):
        program = f"import __main__ as m, sys\nm.send(int(sys.argv[2]), {{'ready': {bad}}})\nimport os\nos._exit(0)\n"
        verdict = code(MBPP, program)
        assert verdict.outcome == "error" and "unreadable" in verdict.reason, (bad, verdict)


def test_malformed_tester_output_is_a_judge_error_never_an_exception():
    from methods.judges.code import _read_counts

    for bad in (b"", b"{}", b"[]", b"not json", b'{"passed": 5, "total": 3, "errors": []}', b'{"passed": "3"}'):
        assert _read_counts(bad) is None, bad
    assert _read_counts(b'noise\n{"passed": 1, "total": 2, "errors": ["x"]}\n')["passed"] == 1


def test_nothing_outside_the_sandbox_can_be_read_or_written(code, tmp_path):
    from tests.conftest import SHARED

    repo = Path(__file__).resolve().parents[1]
    marker = f"kb-escape-{os.getpid()}"
    program = (
        "import os\n"
        "leaked = []\n"
        f"for p in ['/etc/passwd', {str(repo / 'README.md')!r}, {str(SHARED / 'docs' / 'PLAN.md')!r}, '/root', "
        f"{str(tmp_path)!r}]:\n"
        "    try:\n"
        "        open(p).read(1) if not os.path.isdir(p) else os.listdir(p)\n"
        "        leaked.append(p)\n"
        "    except OSError:\n"
        "        pass\n"
        "made = []\n"
        f"for make in (lambda: os.mkdir('/tmp/{marker}-dir'), lambda: os.symlink('/etc', '/tmp/{marker}-link'),\n"
        f"             lambda: open('/tmp/{marker}-file', 'w').write('x'),\n"
        f"             lambda: os.rename('/tmp/{marker}-file', '/tmp/{marker}-moved')):\n"
        "    try:\n"
        "        make()\n"
        "        made.append(1)\n"
        "    except OSError:\n"
        "        pass\n"
    )
    verdict = code(Task("reads", "?", tests=("assert leaked == []", "assert made")), program)
    assert verdict.passed, verdict  # made inside the sandbox's own /tmp ...
    for suffix in ("-dir", "-link", "-file", "-moved"):  # ... which is not the machine's
        assert not Path(f"/tmp/{marker}{suffix}").exists() and not Path(f"/tmp/{marker}{suffix}").is_symlink()


def test_the_disk_is_capped(code):
    program = (
        "block = b'x' * (1 << 20)\nwith open('big', 'wb') as f:\n    for _ in range(1024):\n        f.write(block)\n"
    )
    verdict = code(MBPP, program)
    assert verdict.outcome == "error" and ("No space left" in verdict.reason or "File too large" in verdict.reason)


def _run_beside(code, hostile: str, neighbours: int, delay: float, task=MBPP) -> list:
    """``hostile`` judged, and ``neighbours`` right answers judged while it runs (four slots)."""
    import threading

    import methods.judges.code as code_module

    right = "def add(a, b):\n    return a + b + int(a == b == 0)\n"
    out: list = []
    slots = code_module._SLOTS
    code_module._SLOTS = threading.BoundedSemaphore(neighbours + 1)
    try:
        bad = threading.Thread(target=lambda: out.append(("hostile", code(task, hostile))))
        bad.start()
        time.sleep(delay)
        good = [threading.Thread(target=lambda: out.append(("right", code(task, right)))) for _ in range(neighbours)]
        for t in good:
            t.start()
        for t in (*good, bad):
            t.join(120)
    finally:
        code_module._SLOTS = slots
    return out


def test_one_answer_cannot_make_its_neighbours_judge_errors(code):
    """RLIMIT_NPROC counts a uid's processes on the whole machine: a candidate holding 60 sleeping
    processes as ``nobody`` made every sandbox judged beside it fail to start. As root each
    sandbox runs as a uid of its own (and in a pids cgroup of its own where there is one)."""
    from methods.judges.code import isolation

    if not isolation()["own_uid"]:
        pytest.skip("a uid per sandbox needs root and unprivileged user namespaces")
    hog = (
        "import _posixsubprocess, os, sys, time\n"
        "held = 0\n"
        "for _ in range(200):\n"
        "    r, w = os.pipe()\n"
        "    try:\n"
        "        _posixsubprocess.fork_exec([sys.executable, '-c', 'import time; time.sleep(30)'],"
        " [sys.executable.encode()], True, (), None, None, -1, -1, -1, -1, -1, -1, r, w, True, True, -1, None, None,"
        " -1, -1, None, False)\n"
        "        held += 1\n"
        "    except OSError:\n"
        "        break\n"
        "    finally:\n"
        "        os.close(r)\n"
        "        os.close(w)\n"
        "time.sleep(4)\n"
        "def add(a, b):\n"
        "    return held\n"
    )
    verdicts = _run_beside(code, hog, neighbours=2, delay=1.5)
    right = [v for who, v in verdicts if who == "right"]
    assert len(right) == 2 and all(v.passed for v in right), right
    hostile = next(v for who, v in verdicts if who == "hostile")
    assert hostile.outcome == "failed" and "AssertionError" in hostile.reason  # it held its processes, and failed


def test_a_sandbox_failure_is_judged_again_and_never_counted_as_the_answers(monkeypatch):
    """A verdict the machine produced (a sandbox that could not start, a tester that gave nothing
    readable) is not the answer's: the judge runs the answer again, and after its last attempt
    says ``judge_error`` with ``infrastructure``, which the stages count apart from failures."""
    import methods.judges.code as code_module
    from methods.judges.code import CodeJudge, SandboxResult

    calls = []
    real = code_module.run_sandboxed

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise OSError(11, "Resource temporarily unavailable")
        if len(calls) == 2:
            return SandboxResult("exited", 1, "", "setpriv: failed to execute bwrap", 0.01), None
        return real(*args, **kwargs)

    monkeypatch.setattr(code_module, "run_sandboxed", flaky)
    monkeypatch.setattr(code_module.time, "sleep", lambda s: None)
    judge = CodeJudge(wall_seconds=8, cpu_seconds=3, memory_mb=512, weak_sandbox_ok=True)
    verdict = judge(Task("t", "?", tests=MBPP.tests[:2]), "def add(a, b):\n    return a + b\n")
    assert verdict.passed and verdict.details["attempts"] == 3 and len(calls) == 3, verdict

    calls.clear()
    monkeypatch.setattr(
        code_module, "run_sandboxed", lambda *a, **k: calls.append(1) or (_ for _ in ()).throw(OSError(11, "no"))
    )
    verdict = judge(MBPP, "def add(a, b):\n    return a + b\n")
    assert verdict.outcome == "judge_error" and verdict.details["infrastructure"] and len(calls) == 3
    assert not verdict.passed


def test_only_tmp_is_writable_even_without_the_audit_hook(code):
    """The sandbox's ``/``, ``/dev`` and ``/dev/shm`` were writable tmpfs without a size cap (a child
    process, which the audit hook does not follow, wrote 304 MB there). They are read-only: the
    16 MB ``/tmp`` is the one writable place."""
    child = (
        "import json, os\n"
        "wrote = []\n"
        "for d in ['/', '/dev', '/dev/shm', '/usr', '/proc', '/tmp']:\n"
        "    try:\n"
        "        with open(os.path.join(d, 'kb-fill'), 'wb') as f:\n"
        "            f.write(b'x' * (1 << 20))\n"
        "        wrote.append(d)\n"
        "    except OSError:\n"
        "        pass\n"
        "open('/tmp/out.json', 'w').write(json.dumps(wrote))\n"
    )
    program = (
        "import _posixsubprocess, json, os, sys, time\n"
        "r, w = os.pipe()\n"
        f"_posixsubprocess.fork_exec([sys.executable, '-c', {child!r}], [sys.executable.encode()], True, (), None,"
        " None, -1, -1, -1, -1, -1, -1, r, w, True, False, -1, None, None, -1, -1, None, False)\n"
        "for _ in range(200):\n"
        "    if os.path.exists('/tmp/out.json'):\n"
        "        break\n"
        "    time.sleep(0.02)\n"
        "time.sleep(0.1)\n"
        "wrote = json.load(open('/tmp/out.json'))\n"
    )
    verdict = code(Task("ro", "?", tests=("assert wrote == ['/tmp'], wrote",)), program)
    assert verdict.passed, verdict


def test_the_memory_limit_holds_for_the_answer_as_a_whole(code):
    """``memory_mb`` was a limit per process: 5 children of 200 MB each peaked at 1,065 MB under
    256 MB and passed. With a cgroup per sandbox the limit is the answer's, all its processes
    together: past it the kernel kills one, and the verdict is an error naming the limit."""
    from methods.judges.code import isolation

    if not isolation()["cgroup"]:
        pytest.skip("a memory limit for all of an answer's processes needs a cgroup this process may make (root)")
    small = make_judge("code", wall_seconds=10, cpu_seconds=5, memory_mb=256)
    child = "x = bytearray(200 << 20)\nfor i in range(0, len(x), 4096):\n    x[i] = 1\nimport time\ntime.sleep(4)\n"
    program = (
        "import _posixsubprocess, os, sys, time\n"
        "for _ in range(5):\n"
        "    r, w = os.pipe()\n"
        f"    _posixsubprocess.fork_exec([sys.executable, '-c', {child!r}], [sys.executable.encode()], True, (), None,"
        " None, -1, -1, -1, -1, -1, -1, r, w, True, True, -1, None, None, -1, -1, None, False)\n"
        "    os.close(r)\n"
        "    os.close(w)\n"
        "time.sleep(3)\n"
        "def add(a, b):\n"
        "    return a + b + int(a == b == 0)\n"
    )
    verdict = small(MBPP, program)
    assert verdict.outcome == "error" and "memory limit (256 MB" in verdict.reason, verdict
    assert verdict.details["peak_memory_mb"] <= 256
    fine = small(MBPP, "def add(a, b):\n    return a + b + int(a == b == 0)\n")
    assert fine.passed and 0 < fine.details["peak_memory_mb"] < 256, fine


def test_the_sandboxs_loopback_is_its_own(code):
    """bubblewrap's network namespace has one interface, a loopback that is up and private: a
    process in the sandbox (one the audit hook does not follow) reaches its own 127.0.0.1 and
    nothing listening on the host's."""
    import socket

    host = socket.create_server(("127.0.0.1", 0))
    port = host.getsockname()[1]
    child = (
        "import json, socket\n"
        "seen = {}\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        "    seen['host'] = 'reached'\n"
        "except OSError as e:\n"
        "    seen['host'] = type(e).__name__\n"
        "own = socket.create_server(('127.0.0.1', 0))\n"
        "socket.create_connection(own.getsockname(), timeout=2)\n"
        "seen['own'] = 'reached'\n"
        "open('/tmp/net.json', 'w').write(json.dumps(seen))\n"
    )
    program = (
        "import _posixsubprocess, json, os, sys, time\n"
        "r, w = os.pipe()\n"
        f"_posixsubprocess.fork_exec([sys.executable, '-c', {child!r}], [sys.executable.encode()], True, (), None,"
        " None, -1, -1, -1, -1, -1, -1, r, w, True, False, -1, None, None, -1, -1, None, False)\n"
        "for _ in range(250):\n"
        "    if os.path.exists('/tmp/net.json'):\n"
        "        break\n"
        "    time.sleep(0.02)\n"
        "time.sleep(0.1)\n"
        "seen = json.load(open('/tmp/net.json'))\n"
    )
    try:
        verdict = code(
            Task("net", "?", tests=("assert seen == {'host': 'ConnectionRefusedError', 'own': 'reached'}, seen",)),
            program,
        )
    finally:
        host.close()
    assert verdict.passed, verdict


def _sandbox_processes(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_a_survivor_dies_with_the_sandbox_and_cannot_poison_later_verdicts(code):
    """The escape of the old sandbox: _posixsubprocess.fork_exec raises no audit event, and
    call_setsid put the child out of the killed process group; it outlived the verdict and rewrote
    later tasks' tests. Here it is a process of the sandbox's PID namespace: gone with the verdict,
    and later tasks' tests are not in any sandbox a candidate can reach."""
    marker = f"kb-survivor-{os.getpid()}-{time.monotonic_ns()}"
    survivor = (
        "import glob, os, time\n"
        f"# {marker}\n"
        "deadline = time.time() + 60\n"
        "while time.time() < deadline:\n"
        "    for path in glob.glob('/tmp/**/*.json', recursive=True) + glob.glob('/tmp/kibidango-*/**', "
        "recursive=True):\n"
        "        try:\n"
        '            open(path, \'w\').write(\'{"program": "", "tests": ["pass"], "setup": ""}\')\n'
        "        except OSError:\n"
        "            pass\n"
        "    time.sleep(0.01)\n"
    )
    program = (
        "import _posixsubprocess, os, sys\n"
        f"src = {survivor!r}\n"
        "r, w = os.pipe()\n"
        "started = _posixsubprocess.fork_exec([sys.executable, '-c', src], [sys.executable.encode()], True, (),"
        " None, None, -1, -1, -1, -1, -1, -1, r, w, True, True, -1, None, None, -1, -1, None, False) > 0\n"
        "def add(a, b):\n"
        "    return 0\n"
    )
    first = code(Task("survivor", "?", tests=("assert started", "assert add(1, 2) == 3")), program)
    assert first.outcome == "failed" and first.score == 0.5, first  # the survivor was started, unseen by any hook
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:  # the verdict is back: not one process of the sandbox runs
        assert _sandbox_processes(marker) == []
        time.sleep(0.05)
    for _ in range(3):  # later wrong answers stay wrong
        later = code(MBPP, "def add(a, b):\n    return a - b\n")
        assert later.outcome == "failed" and later.score == 0, later


def test_without_bubblewrap_code_is_judged_only_when_the_settings_accept_the_fallback(monkeypatch):
    import methods.judges.code as sandbox

    fallback = {"kind": "fallback", **sandbox._fallback()}
    monkeypatch.setattr(sandbox, "isolation", lambda: fallback)
    with pytest.raises(sandbox.SandboxUnavailable, match="weak_sandbox_ok"):
        make_judge("code")(MBPP, "def add(a, b):\n    return a + b\n")
    weak = make_judge("code", weak_sandbox_ok=True, wall_seconds=8)
    verdict = weak(Task("w", "?", tests=MBPP.tests[:2]), "def add(a, b):\n    return a + b\n")
    assert verdict.passed and verdict.details["isolation"]["kind"] == "fallback"
    if os.geteuid() == 0 and fallback["network_namespace"]:
        assert verdict.details["isolation"]["user_nobody"]  # as root: the candidate runs as nobody
    forged = weak(MBPP, 'print(\'{"passed": 3, "total": 3, "errors": []}\')\nimport os\nos._exit(0)\n')
    assert not forged.passed  # the verdict channel holds in the fallback too


def test_the_sandboxes_start_without_forking_the_judges_process(code, monkeypatch):
    """Limits and the drop to nobody are programs in the sandbox's argv (prlimit, setpriv), not a
    preexec_fn: with one, subprocess fork()s the judge's whole process (a stage's loaded model and
    all), and the decoding beside it pays a copy-on-write fault per page it writes afterwards."""
    import shutil
    import subprocess

    if not (shutil.which("prlimit") and shutil.which("setpriv")):
        pytest.skip("needs util-linux's prlimit and setpriv")
    spawns = []
    real = subprocess.Popen.__init__

    def record(self, args, *rest, **kwargs):
        spawns.append((list(args), kwargs.get("preexec_fn")))
        real(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", record)
    verdict = code(MBPP, "def add(a, b):\n    return a + b\n")
    assert verdict.outcome == "failed" and len(spawns) == 2  # it ran: the candidate's sandbox and the tester's
    iso = verdict.details["isolation"]
    uids = []
    for argv, preexec in spawns:
        assert preexec is None and os.path.basename(argv[0]) == "prlimit", argv
        assert "--cpu=3:4" in argv and f"--as={512 << 20}" in argv and "--core=0" in argv
        if iso["own_uid"]:
            setpriv = argv[argv.index("--") + 1 :]
            assert setpriv[0].endswith("setpriv") and setpriv[1].startswith("--reuid="), argv
            uids.append(int(setpriv[1].removeprefix("--reuid=")))
    if iso["own_uid"]:  # each sandbox a uid of its own, none of them a user's (nor nobody)
        assert len(set(uids)) == 2 and all(u >= 1_000_000_000 for u in uids), uids


def test_judged_programs_wait_for_a_slot_before_their_wall_limit_starts(code, monkeypatch):
    """An answering stage judges up to its ``parallel`` answers at once; a program starts (and its
    wall limit with it) only when one of the cpu-count slots is free, not while it queues."""
    import threading

    from methods.judges import code as code_module

    slots = threading.BoundedSemaphore(1)
    monkeypatch.setattr(code_module, "_SLOTS", slots)
    started = []
    real = code_module._run
    monkeypatch.setattr(code_module, "_run", lambda *a: (started.append(1), real(*a))[1])
    verdicts = []
    slots.acquire()
    judging = threading.Thread(target=lambda: verdicts.append(code(MBPP, "def add(a, b):\n    return a + b\n")))
    judging.start()
    judging.join(0.5)
    assert judging.is_alive() and not started  # queued for the slot, nothing spawned
    slots.release()
    judging.join(60)
    assert started and verdicts[0].outcome == "failed"


def test_the_sandbox_says_how_it_isolates(code):
    verdict = code(MBPP, "def add(a, b):\n    return a + b\n")
    iso = verdict.details["isolation"]
    assert set(iso) == {"kind", "network_namespace", "user_nobody", "own_uid", "cgroup", "python"}
    assert iso["kind"] == "bubblewrap" and iso["network_namespace"] and iso["user_nobody"]
    assert iso["own_uid"] == (os.geteuid() == 0)


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
    free = LLMJudge(
        base_url=base, model="stories260K", api_key_env=OPENAI_KEY_ENV, response_format="none", max_tokens=16
    )
    assert free(task, "Blue.").outcome == "judge_error"

    # An endpoint that rejects the request shape (llama-cpp-python knows no json_schema format).
    strict = LLMJudge(
        base_url=base, model="stories260K", api_key_env=OPENAI_KEY_ENV, response_format="json_schema", max_attempts=1
    )
    assert strict(task, "Blue.").outcome == "judge_error"


def test_llm_judge_with_a_real_instruct_model_gives_real_json_verdicts(instruct_server, monkeypatch):
    """SmolLM2-135M-Instruct behind llama-cpp-python's server: the judge's request yields a JSON
    verdict it parses (not the judge_error a story model gives), with the reply's usage and cost."""
    base, key = instruct_server
    monkeypatch.setenv(OPENAI_KEY_ENV, key)
    judge = make_judge("llm", base_url=base, model="smollm2", api_key_env=OPENAI_KEY_ENV, response_format="json_object")
    tasks = [
        (Task("g-1", "What colour is the sky on a clear day?", reference="Blue."), "The sky is blue."),
        (Task("g-2", "What is 2 + 3?", reference="5"), "2 + 3 = 5"),
        (Task("g-3", "Name the capital of France.", reference="Paris."), "The capital of France is Paris."),
    ]
    verdicts = [judge(task, answer) for task, answer in tasks]
    for v in verdicts:
        assert v.outcome in ("passed", "failed"), v.reason  # a verdict, not a judge error
        assert 0.0 <= v.score <= 1.0 and v.reason and v.details["prompt_tokens"] > 0 and v.cost > 0
        assert key not in repr(v)


def test_llm_judge_errors_name_the_variable_never_the_key(openai_server, monkeypatch):
    from core.contract import KibidangoError
    from methods.judges.llm import JudgeConfigError, LLMJudge

    base, key = openai_server
    monkeypatch.delenv(OPENAI_KEY_ENV, raising=False)
    with pytest.raises(KibidangoError, match=OPENAI_KEY_ENV):
        LLMJudge(base_url=base, model="stories260K", api_key_env=OPENAI_KEY_ENV)
    wrong = "sk-" + "x" * 40
    monkeypatch.setenv(OPENAI_KEY_ENV, wrong)
    with pytest.raises(JudgeConfigError, match="401") as err:
        LLMJudge(base_url=base, model="stories260K", api_key_env=OPENAI_KEY_ENV, response_format="json_object")(
            Task("t", "?"), "a"
        )
    assert wrong not in str(err.value) and key not in str(err.value) and OPENAI_KEY_ENV in str(err.value)

    # An endpoint that does not answer: a retryable judge_error, never a pass.
    monkeypatch.setenv(OPENAI_KEY_ENV, key)
    gone = LLMJudge(
        base_url="http://127.0.0.1:9/v1", model="m", api_key_env=OPENAI_KEY_ENV, max_attempts=1, timeout_s=2
    )
    verdict = gone(Task("t", "?"), "a")
    assert verdict.outcome == "judge_error" and verdict.details["retryable"] and not verdict.passed


def test_judge_settings_are_typed_per_kind_and_match_the_judges():
    """A recipe's judges are a tagged union per kind: an unknown setting, a missing one or a value
    out of range is refused naming the domain and the field; every kind's settings are exactly its
    judge's constructor arguments, with the same defaults."""
    import dataclasses

    from pydantic import ValidationError

    from methods.heldout import HeldOutTasks
    from methods.judges import _class
    from methods.judges.settings import CodeJudgeSettings, LLMJudgeSettings, MathJudgeSettings, ReferenceJudgeSettings

    for settings in (MathJudgeSettings, CodeJudgeSettings, ReferenceJudgeSettings):
        kind = settings.model_fields["kind"].default
        judge_fields = {f.name: f for f in dataclasses.fields(_class(kind)) if f.init}
        assert set(settings.model_fields) == set(judge_fields), kind
        for name, f in judge_fields.items():
            if f.default is not dataclasses.MISSING:
                assert settings.model_fields[name].default == f.default, (kind, name)
    # the llm judge holds its settings (an endpoint's, shared with the teacher tiers and the cascade)
    llm = _class("llm")(base_url="http://127.0.0.1:9/v1", model="m")
    assert isinstance(llm.settings, LLMJudgeSettings) and llm.settings.max_attempts == 3

    sample = {"name": "g", "source": "stage0", "domain": "general", "size": 3}
    ok = HeldOutTasks.model_validate({"samples": [sample], "judges": {"general": {"kind": "reference"}}})
    assert ok.judges["general"].threshold == 0.4
    for judges, message in (
        ({"general": {"kind": "reference", "treshold": 0.5}}, r"judges\.general\.reference\.treshold"),
        ({"general": {"kind": "referee"}}, r"(?s)judges\.general.*'math', 'code', 'reference', 'llm'"),
        ({"general": {"kind": "reference", "threshold": 2}}, r"judges\.general\.reference\.threshold"),
        ({"general": {"kind": "llm", "model": "m"}}, r"judges\.general\.llm\.base_url"),
        ({"math": {"kind": "math"}}, r"sample 'g': no judge for its domain 'general'"),
        ({"general": {"kind": "code"}}, r"stage-0 rows carry no tests"),
    ):
        with pytest.raises(ValidationError, match=message):
            HeldOutTasks.model_validate({"samples": [sample], "judges": judges})


# ---- what the code judge runs of an answer ------------------------------------------------------


def test_the_program_is_found_however_the_answer_wraps_it():
    """The demo's last code answer was judged "SyntaxError": its code sat before a lone closing
    fence and prose. Fences open or closed, prose before or after, test calls after the function,
    a body completing a given signature: the program is what the judge runs (EvalPlus's sanitizer)."""
    from methods.judges.extract import extract_program, format_failure

    square = "def solve(xs):\n    return sum(x * x for x in xs)"
    for answer in (
        square + "\n```\nThis squares each number and adds them up.",  # the demo's answer
        "Here is the function:\n```python\n" + square + "\n```\nIt works.",
        "```python\n" + square + "\n",  # a fence left open at the end of the tokens
        "Sure!\n" + square + "\n\nExplanation: it uses a generator.",
        "```\n" + square + "\nprint(solve([1, 2]))\nassert solve([]) == 0\n```",
        square + "\nif __name__ == '__main__':\n    print(solve([3]))\n",
    ):
        program = extract_program(answer, ("solve",))
        assert format_failure(program) is None and program.strip() == square, (answer, program)
    helper = (
        "import math\n\nK = 2\n\ndef helper(x):\n    return x * K\n\ndef unused():\n    return 0\n\n"
        "def f(x):\n    return helper(x)\n"
    )
    kept = extract_program(helper + "print(f(3))\n", ("f",))
    assert "def helper" in kept and "K = 2" in kept and "import math" in kept and "print" not in kept
    prompt = 'def inc(x):\n    """Return x + 1."""\n'
    body = extract_program("    return x + 1\n```\nThat adds one.", ("inc",), prompt)
    assert body.strip().endswith("return x + 1") and body.startswith("def inc(x):")
    for nothing in ("I am not sure how to do that.", "", "```\n```"):
        assert format_failure(extract_program(nothing, ("f",))) is not None, nothing


def test_a_format_failure_is_an_error_the_stages_count_apart(code):
    verdict = code(MBPP, "I cannot write that function.")
    assert verdict.outcome == "error" and verdict.details["format_failure"] and not verdict.passed
    wrapped = code(
        Task("w", "?", reference="def add(a, b):\n    return a + b\n", tests=MBPP.tests[:2]),
        "def add(a, b):\n    return a + b\n```\nThis adds two numbers.",
    )
    assert wrapped.passed, wrapped


def test_the_sandbox_codec_passes_plain_data_by_value_and_the_rest_as_handles():
    """The codec both sandboxes run (methods/judges/sandbox/codec.py, imported here as a module):
    plain data comes back as builtins of the same value; anything else only as a handle its owner
    resolves; malformed input is refused, never evaluated."""
    import io
    import json

    from methods.judges.sandbox import CANDIDATE, TESTER, candidate, codec, tester

    kept = []

    def leaf(x):
        kept.append(x)
        return {"h": len(kept) - 1, "type": type(x).__name__}

    value = [
        1,
        2.5,
        -3j,
        "s",
        b"b",
        bytearray(b"a"),
        (1,),
        {2},
        frozenset({3}),
        {"k": [None, True]},
        range(1, 5, 2),
        int,
    ]
    assert codec.dec(codec.enc(value, leaf), lambda h: kept[h["h"]]) == value
    assert list(codec.dec(codec.enc(iter([1, 2]), leaf), None)) == [1, 2]
    rigged = type("Rigged", (), {"__eq__": lambda self, other: True})()
    handle = codec.enc(rigged, leaf)
    assert handle == {"h": 0, "type": "Rigged"} and codec.dec(handle, lambda h: kept[h["h"]]) is rigged
    for bad in ({}, {"i": "1", "f": "2"}, {"zz": 1}, 5, {"type": "os"}):
        with pytest.raises(ValueError):
            codec.dec(bad, None)
    # the tester turns the candidate's handles into opaque objects that can only be passed back
    h = tester.Handles()({"h": 7, "type": "Tree"})
    assert repr(h) == "<Tree object in the sandbox>" and tester.leaf(h) == {"h": 7}
    with pytest.raises(TypeError, match="plain data only"):
        tester.leaf(io.StringIO())
    # the candidate's names: callables by name, plain values encoded, modules by their own name
    ns = {"__name__": "__main__", "f": len, "x": [1], "json": json, "it": iter([1])}
    assert candidate.names(ns, leaf) == {
        "callables": ["f"],
        "values": {"x": {"l": [{"i": "1"}]}},
        "modules": {"json": "json"},
    }
    assert CANDIDATE.is_file() and TESTER.is_file() and CANDIDATE.parent == TESTER.parent


def test_the_judges_parse_python_one_thread_at_a_time():
    """CPython 3.11's AST construction raised SystemError ("recursion depth mismatch",
    python/cpython#106905) under parses on concurrent threads (a study's evaluation judges 16
    answers at once): every parse in the judges goes through extract.parse's lock."""
    import inspect

    from methods.judges import code, extract

    for module in (code, extract):
        source = inspect.getsource(module).replace(inspect.getsource(extract.parse), "")
        assert "ast.parse(" not in source, module.__name__
    assert isinstance(extract._AST_LOCK, type(__import__("threading").Lock()))
    assert [type(n).__name__ for n in extract.parse("def f(x):\n    return x\n").body] == ["FunctionDef"]

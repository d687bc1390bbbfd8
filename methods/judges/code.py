"""The code judge: the candidate program runs against the task's tests in a sandbox, never in the
pipeline's process.

The sandbox (:func:`run_sandboxed`) is a child Python (``-I``: isolated, no user site, PYTHON*
variables ignored) in a fresh temporary directory, with

- an empty environment (``PATH``, ``HOME`` = the directory, ``LANG``): no API key is there to read;
- resource limits (``resource``): CPU seconds, address space, file size (which also caps stdout and
  stderr, written to files), open files, and processes;
- a wall-clock timeout, after which its whole process group is killed (so is whatever it left);
- no network: a new network namespace (util-linux ``unshare --net``) where the OS allows it, with
  only a loopback that is down; and when started as root, the user ``nobody`` (``unshare -S/-G``),
  so the process limit applies and nothing outside world-writable places can be written;
- an audit hook (PEP 578) installed before the candidate runs that refuses writes outside the
  directory, sockets, starting processes (fork, exec, subprocess, os.system) and ctypes.

What this does not do: the audit hook is a tripwire, not a wall (a C extension can go around it),
and as ``nobody`` a program that got past it could still write to world-writable directories such
as /tmp (no private mount namespace); without root or user namespaces there is no network
namespace and no separate user, and the sandbox says so in ``isolation``. A program written to forge the result line could claim a pass: the sandbox
protects the machine, and the judge trusts answers not to attack its bookkeeping.

Outcomes: ``passed`` (every test passed), ``failed`` (it ran; some tests failed; ``score`` is the
share that passed), ``timeout`` (wall or CPU limit), ``error`` (it crashed, hit a limit, or did
something the sandbox refuses; the reason says which).
"""

from __future__ import annotations

import json
import os
import re
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from methods.judges.base import Task, Verdict

__all__ = ["CodeJudge", "SandboxLimits", "SandboxResult", "isolation", "run_sandboxed"]

_NOBODY = 65534

_GUARD = r"""
import json, os, sys
_root = os.path.realpath(os.getcwd())
_nonce = sys.stdin.readline().strip()
sys.stdin.close()
_BLOCKED = {"os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen",
            "os.kill", "os.killpg", "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg",
            "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.call_function"}
_W = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
def _hook(event, args):
    if event in _BLOCKED:
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open" and args and not isinstance(args[0], int):
        mode, flags = (args + (None, 0))[1:3]
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & _W)
        if writing and not os.path.realpath(os.fsdecode(args[0])).startswith(_root + os.sep):
            raise PermissionError(f"sandbox: writing outside the sandbox is not allowed: {os.fsdecode(args[0])}")
sys.addaudithook(_hook)
with open("task.json") as f:
    _task = json.load(f)
_ns = {"__name__": "__main__"}
_result = {"passed": 0, "total": len(_task["tests"]), "errors": []}
try:
    exec(compile(_task["program"], "candidate.py", "exec"), _ns)
    if _task["setup"]:
        exec(compile(_task["setup"], "setup.py", "exec"), _ns)
except BaseException as e:
    _result["crash"] = f"{type(e).__name__}: {str(e)[:300]}"
else:
    for i, test in enumerate(_task["tests"]):
        try:
            exec(compile(test, f"test_{i}.py", "exec"), _ns)
            _result["passed"] += 1
        except BaseException as e:
            _result["errors"].append(f"test {i}: {type(e).__name__}: {str(e)[:200]}")
sys.stdout.flush()
print(f"\n{_nonce} " + json.dumps(_result), flush=True)
"""


@dataclass(frozen=True)
class SandboxLimits:
    wall_seconds: float = 10.0
    cpu_seconds: int = 5
    memory_bytes: int = 1 << 30
    file_bytes: int = 8 << 20
    processes: int = 64
    open_files: int = 64
    output_chars: int = 4000


@dataclass
class SandboxResult:
    status: str  # "exited", "timeout", "signalled"
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    isolation: dict = field(default_factory=dict)


@lru_cache(maxsize=1)
def isolation() -> dict:
    """What this machine lets the sandbox do: a network namespace, a separate user, and the
    interpreter it runs (as ``nobody`` it must be one that ``nobody`` may execute: a virtualenv
    under /root is not)."""
    unshare = shutil.which("unshare")
    root = os.geteuid() == 0
    system = [p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.path.exists(p)]
    candidates = list(dict.fromkeys([sys.executable, getattr(sys, "_base_executable", sys.executable), *system]))
    modes = ([["-S", str(_NOBODY), "-G", str(_NOBODY)]] if root else []) + [[] if root else ["--map-root-user"]]
    if unshare:
        for user in modes:
            for python in (c for c in candidates if c):
                try:
                    probe = [unshare, "--net", *user, "--", python, "-I", "-c", "pass"]
                    if subprocess.run(probe, capture_output=True, timeout=20).returncode == 0:
                        args = [unshare, "--net", *user, "--"]
                        return {
                            "network_namespace": True,
                            "user_nobody": bool(user) and root,
                            "python": python,
                            "unshare_args": args,
                        }
                except (OSError, subprocess.SubprocessError):
                    continue
    return {"network_namespace": False, "user_nobody": False, "python": sys.executable, "unshare_args": []}


def _limits(limits: SandboxLimits):
    def apply() -> None:
        os.setsid()
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds + 1))
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def run_sandboxed(
    program: str, tests: list[str], setup: str = "", limits: SandboxLimits | None = None
) -> tuple[SandboxResult, dict | None]:
    """Run ``program`` then each of ``tests`` (statements) in the sandbox; returns the process
    result and the guard's count of passed tests (None if the program never got that far)."""
    limits = limits or SandboxLimits()
    iso = isolation()
    work = Path(tempfile.mkdtemp(prefix="kibidango-sandbox-"))
    nonce = secrets.token_hex(16)
    try:
        (work / "guard.py").write_text(_GUARD)
        (work / "task.json").write_text(json.dumps({"program": program, "tests": tests, "setup": setup}))
        out, err = open(work / "stdout.txt", "wb"), open(work / "stderr.txt", "wb")
        command = [*iso["unshare_args"], iso["python"], "-I", "guard.py"]
        if iso["user_nobody"]:
            for p in (work, *work.iterdir()):
                os.chown(p, _NOBODY, _NOBODY)
        env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "LANG": "C.UTF-8"}
        started = time.monotonic()
        proc = subprocess.Popen(
            command, cwd=work, env=env, stdin=subprocess.PIPE, stdout=out, stderr=err, preexec_fn=_limits(limits)
        )
        out.close()
        err.close()
        try:
            proc.stdin.write((nonce + "\n").encode())
            proc.stdin.close()
        except OSError:
            pass
        status = "exited"
        try:
            proc.wait(timeout=limits.wall_seconds)
        except subprocess.TimeoutExpired:
            status = "timeout"
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the group: whatever it started dies with it
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        seconds = time.monotonic() - started
        if status == "exited" and proc.returncode < 0:
            status = "signalled"
        stdout = (work / "stdout.txt").read_bytes().decode("utf-8", "replace")
        stderr = (work / "stderr.txt").read_bytes()[: limits.output_chars * 4].decode("utf-8", "replace")
        counts = None
        for line in stdout.splitlines():
            if line.startswith(nonce + " "):
                counts = json.loads(line[len(nonce) + 1 :])
        visible = "\n".join(line for line in stdout.splitlines() if not line.startswith(nonce))
        where = {k: iso[k] for k in ("network_namespace", "user_nobody", "python")}
        result = SandboxResult(
            status, proc.returncode, visible[: limits.output_chars], stderr[: limits.output_chars], seconds, where
        )
        return result, counts
    finally:
        shutil.rmtree(work, ignore_errors=True)


def extract_code(answer: str) -> str:
    """The program in an answer: the first fenced block if there is one, else the whole text."""
    if "```" in answer:
        body = answer.split("```", 2)[1]
        first, _, rest = body.partition("\n")
        return rest if first.strip().isalpha() else body  # a language tag on the fence line
    return answer


@dataclass
class CodeJudge:
    """Runs the answer's program against ``task.tests`` (MBPP: assert statements) or HumanEval's
    ``check`` (one test: ``check(entry_point)`` after the check function's definition)."""

    wall_seconds: float = 10.0
    cpu_seconds: int = 5
    memory_mb: int = 1024
    kind: str = "code"

    def __call__(self, task: Task, answer: str) -> Verdict:
        started = time.monotonic()
        if not task.tests:
            return Verdict(False, 0.0, f"task {task.id} has no tests", "judge_error", 0.0)
        tests = list(task.tests)
        setup = task.setup
        if task.entry_point:  # HumanEval: the check function, then one call of it
            setup = (setup + "\n" + "\n".join(tests)).strip()
            tests = [f"check({task.entry_point})"]
        program = extract_code(answer)
        if task.entry_point and not re.search(rf"^def {re.escape(task.entry_point)}\s*\(", program, re.MULTILINE):
            program = task.prompt + program  # HumanEval: a body completing the prompt's signature
        limits = SandboxLimits(
            wall_seconds=self.wall_seconds, cpu_seconds=self.cpu_seconds, memory_bytes=self.memory_mb << 20
        )
        result, counts = run_sandboxed(program, tests, setup, limits)
        cost = time.monotonic() - started
        details = {"isolation": result.isolation, "seconds": round(result.seconds, 3), "returncode": result.returncode}
        if result.status == "timeout" or result.returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
            limit = "wall" if result.status == "timeout" else "CPU"
            return Verdict(False, 0.0, f"timeout: the {limit} limit was reached", "timeout", cost, details)
        if counts is None:
            why = (
                _last_error(result.stderr) or f"the program ended with status {result.returncode} before its tests ran"
            )
            return Verdict(False, 0.0, f"error: {why}", "error", cost, details)
        if "crash" in counts:
            return Verdict(False, 0.0, f"error: {counts['crash']}", "error", cost, details)
        passed, total = counts["passed"], counts["total"]
        score = passed / total if total else 0.0
        if passed == total:
            return Verdict(True, 1.0, f"all {total} tests passed", "passed", cost, details)
        return Verdict(False, score, f"{passed}/{total} tests passed; {counts['errors'][0]}", "failed", cost, details)


def _last_error(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""

"""The code judge: the candidate program runs against the task's tests in a sandbox, never in the
pipeline's process — and the tests never run in the candidate's process.

Two processes per task, each in its own **bubblewrap** sandbox (:func:`run_sandboxed`):

- the **candidate** process executes the answer's program (and the task's setup code), then
  answers calls by value: ``name(args)`` in, the return value (or the exception's type and
  message) out, over two pipes;
- the **tester** process holds the tests. It executes each test statement with the candidate's
  functions bound to proxies that make those calls; values cross as plain data (numbers, strings,
  bytes, lists, tuples, sets, dicts, ranges, iterators as their items), decoded into builtin types,
  so no object of the candidate's (a rigged ``__eq__``, say) reaches a test. The tester counts what
  passed and prints the count, which the judge reads from the tester's stdout: a channel the
  candidate has no handle on. A candidate that exits, crashes or hangs mid-test fails that test
  and every later one; it cannot read the tests (they are not in its sandbox), and whatever it
  prints is only its stdout. The tests' namespace is built from the task: the program's names are
  bound only where the tests use them (never a dunder, never a builtin the task does not define),
  and the task's own imports over them, whatever the program's "ready" message claims.

The two programs and their codec are modules of :mod:`methods.judges.sandbox`, run by path
(``python -I .../candidate.py <fds>``), their folder bound read-only into each sandbox.

Each sandbox (``bwrap --unshare-all --new-session --die-with-parent``): its own PID namespace (every
process dies with the sandbox: the judge kills the namespace's init and waits for it), its own
network namespace (one loopback, up and its own), its own mount namespace with only ``/usr`` (and
the interpreter's prefix when it lives elsewhere, and the two programs' folder) bound read-only,
``/`` and ``/dev`` read-only, a private tmpfs ``/tmp`` of ``disk_bytes`` as its only writable place,
a fresh ``/proc``; no repository, no ``../shared``, no home, no ``/etc``; an empty environment (no
API key); uid and gid 65534 inside, and — when the judge runs as root and the kernel allows
unprivileged user namespaces — a uid of its own outside (:mod:`methods.judges.confine`), so one
answer's processes count against no other's. Resource limits (CPU seconds, address space, file size,
open files, processes) and a wall-clock limit hold for both; where a cgroup can be made, the
candidate's memory and process limits hold for all its processes together.

Where bubblewrap cannot run, code is judged only when the settings opt into the weaker fallback
(``weak_sandbox_ok``): the same two processes, the candidate under ``unshare --net`` as ``nobody``
with an audit hook (PEP 578) that refuses writes outside its directory, sockets, new processes
and ctypes — a tripwire, not a wall. ``isolation()["kind"]`` says which ran (``bubblewrap`` or
``fallback``); every verdict's ``details["isolation"]`` carries it and the stages print it in their
cards. The audit hook also runs inside bubblewrap, where it only gives clearer errors.

Outcomes: ``passed`` (every test passed), ``failed`` (it ran; some tests failed; ``score`` is the
share that passed), ``timeout`` (wall or CPU limit), ``error`` (it crashed, hit a limit, or did
something the sandbox refuses; the reason says which), ``judge_error`` (the tester gave no readable
result after ``attempts`` runs — the machine's failure, retryable, never the answer's: never a pass,
never an exception, counted apart by the stages).
"""

from __future__ import annotations

import ast
import dataclasses
import errno
import json
import logging
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import methods.judges.sandbox as sandbox
from methods.judges.base import Task, Verdict
from methods.judges.confine import Cgroup, UidLease, cgroup_support
from methods.judges.extract import extract_program, format_failure, parse
from methods.judges.sandbox import codec

log = logging.getLogger("kibidango.judges.code")

__all__ = [
    "CodeJudge",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailable",
    "isolation",
    "judged_program",
    "run_sandboxed",
]

_NOBODY = 65534
_SYSTEM_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3")


class SandboxUnavailable(RuntimeError):
    """bubblewrap cannot run here and the settings did not opt into the weaker fallback."""


@dataclass(frozen=True)
class SandboxLimits:
    wall_seconds: float = 10.0
    cpu_seconds: int = 5
    memory_bytes: int = 1 << 30
    file_bytes: int = 8 << 20
    disk_bytes: int = 16 << 20
    processes: int = 64
    open_files: int = 64
    output_chars: int = 4000


@dataclass
class SandboxResult:
    status: str  # "exited", "timeout"
    returncode: int | None
    """The candidate process's exit status (bubblewrap passes its child's on)."""
    stdout: str
    stderr: str
    seconds: float
    isolation: dict = field(default_factory=dict)
    peak_memory_bytes: int | None = None
    """The candidate sandbox's peak memory, all its processes together (None without a cgroup)."""
    oom_kills: int = 0
    """Its processes the kernel killed for passing the sandbox's memory limit."""


def _interpreter() -> tuple[str, list[str]]:
    """The Python the sandboxes run and the directories it needs bound read-only: the system's
    under /usr where there is one (a virtualenv's would need the project's tree), else this
    interpreter's base prefix."""
    for python in _SYSTEM_PYTHONS:
        if os.path.exists(python):
            return python, []
    base = getattr(sys, "_base_executable", sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    return os.path.join(prefix, "bin", os.path.basename(base)), [] if prefix.startswith("/usr/") else [prefix]


PROGRAMS = "/kibidango-judge"
"""Where bubblewrap binds :mod:`methods.judges.sandbox` inside a sandbox (its own path would vanish
under the sandbox's private ``/tmp`` when the checkout lives in ``/tmp``)."""


def program_path(script: Path, iso: dict) -> str:
    """The path a sandboxed interpreter runs ``script`` by: inside bubblewrap, under :data:`PROGRAMS`;
    in the fallback (no mount namespace), where it is."""
    return f"{PROGRAMS}/{script.name}" if iso["kind"] == "bubblewrap" else str(script)


def _bwrap_argv(python: str, extra: list[str], limits: SandboxLimits, info_fd: int) -> list[str]:
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--as-pid-1", "--uid", str(_NOBODY)]
    argv += ["--gid", str(_NOBODY), "--hostname", "sandbox", "--info-fd", str(info_fd), "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    for path in extra:  # the interpreter's folders
        argv += ["--ro-bind", path, path]
    argv += ["--ro-bind", str(sandbox.FOLDER), PROGRAMS]  # the programs, at a path no checkout (a /tmp one) hides
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(limits.disk_bytes), "--tmpfs", "/tmp"]
    argv += ["--remount-ro", "/dev", "--remount-ro", "/"]  # the size-capped /tmp is the one writable place
    argv += ["--chdir", "/tmp", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp"]
    return argv + ["--setenv", "LANG", "C.UTF-8", "--", python]


@lru_cache(maxsize=1)
def isolation() -> dict:
    """How code is sandboxed on this machine: ``kind`` is ``bubblewrap`` or ``fallback``
    (``network_namespace``/``user_nobody``: what ``unshare`` could do). ``own_uid``: each sandbox
    runs outside as a uid of its own (as root, where unprivileged user namespaces allow it;
    :mod:`methods.judges.confine`); ``cgroup``: the cgroup version each sandbox gets one of (its
    memory limit then holds for all its processes together), or None."""
    python, extra = _interpreter()
    cgroup = cgroup_support()
    if shutil.which("bwrap"):
        for own_uid in (True, False) if os.geteuid() == 0 else (False,):
            if _bwrap_runs(python, extra, own_uid):
                return {
                    "kind": "bubblewrap",
                    "python": python,
                    "binds": extra,
                    "own_uid": own_uid,
                    "cgroup": cgroup["version"] if cgroup else None,
                    "network_namespace": True,
                    "user_nobody": True,
                }
    return {"kind": "fallback", "own_uid": False, "cgroup": None, **_fallback()}


def _bwrap_runs(python: str, extra: list[str], own_uid: bool) -> bool:
    r, w = os.pipe()
    try:
        with UidLease() if own_uid else nullcontext() as uid:
            argv = _bwrap_argv(python, extra, SandboxLimits(), w)
            prefix = _spawn_prefix(None, uid)
            done = subprocess.run(
                [*(prefix or []), *argv, "-I", "-c", "pass"],
                capture_output=True,
                timeout=20,
                pass_fds=(w,),
                preexec_fn=_limits(None, uid) if uid is not None and prefix is None else None,
            )
        return done.returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        os.close(r)
        os.close(w)


def _fallback() -> dict:
    """What ``unshare`` can do here: a network namespace, and as root the user ``nobody`` — with
    an interpreter ``nobody`` may execute (a virtualenv under /root is not one)."""
    unshare = shutil.which("unshare")
    root = os.geteuid() == 0
    system = [p for p in _SYSTEM_PYTHONS if os.path.exists(p)]
    pythons = list(dict.fromkeys([sys.executable, getattr(sys, "_base_executable", sys.executable), *system]))
    modes = ([["-S", str(_NOBODY), "-G", str(_NOBODY)]] if root else []) + [[] if root else ["--map-root-user"]]
    for user in modes if unshare else []:
        for python in pythons:
            try:
                probe = [unshare, "--net", *user, "--", python, "-I", "-c", "pass"]
                if subprocess.run(probe, capture_output=True, timeout=20).returncode == 0:
                    argv = [unshare, "--net", *user, "--"]
                    return {
                        "network_namespace": True,
                        "user_nobody": bool(user) and root,
                        "python": python,
                        "argv": argv,
                    }
            except (OSError, subprocess.SubprocessError):
                continue
    return {"network_namespace": False, "user_nobody": False, "python": sys.executable, "argv": []}


def _drop(uid: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def _spawn_prefix(limits: SandboxLimits | None, uid: int | None) -> list[str] | None:
    """``limits`` and the drop to ``uid`` as programs that apply them and exec the sandbox
    (util-linux's ``prlimit`` and ``setpriv``), or None where one is missing (then a
    ``preexec_fn`` does it). So no Python runs between fork and exec, and :mod:`subprocess` spawns
    with vfork: a ``preexec_fn`` makes it fork() the judge's whole process, and in a stage that
    judges while it decodes with a model loaded (1B, 1R, 2G, 9) every page the decoding writes
    after each fork then takes a copy-on-write fault — two spawns per judged answer made the
    small preset's 1B decode 3-4x slower, most of its time in the kernel."""
    prlimit, setpriv = shutil.which("prlimit"), shutil.which("setpriv")
    if (limits is not None and prlimit is None) or (uid is not None and setpriv is None):
        return None
    argv = []
    if limits is not None:  # the same limits, in the same order before the drop, as _limits()
        argv += [prlimit, f"--cpu={limits.cpu_seconds}:{limits.cpu_seconds + 1}", f"--as={limits.memory_bytes}"]
        argv += [f"--fsize={limits.file_bytes}", f"--nofile={limits.open_files}", f"--nproc={limits.processes}"]
        argv += ["--core=0", "--"]
    if uid is not None:
        argv += [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
    return argv


def _limits(limits: SandboxLimits | None, uid: int | None):
    def apply() -> None:
        if limits is None:
            if uid is not None:
                _drop(uid)
            return
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds + 1))
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if uid is not None:
            _drop(uid)

    return apply


class _Sandboxed:
    """One process in its sandbox; :meth:`kill` ends it and everything it started, and returns
    only once they are gone."""

    def __init__(
        self,
        script: Path,
        fds: tuple[int, int],
        limits: SandboxLimits,
        iso: dict,
        files: dict,
        cwd: Path,
        uid: int | None = None,
        cgroup: Cgroup | None = None,
    ):
        """``uid``: the uid it runs as outside (bubblewrap as root: a leased one); ``cgroup``: the
        cgroup its namespace's init is moved into once bubblewrap has made the namespaces (see
        :meth:`started`)."""
        self.info = None
        self.cgroup = cgroup
        if iso["kind"] == "bubblewrap":
            info_r, info_w = os.pipe()
            argv = _bwrap_argv(iso["python"], iso["binds"], limits, info_w)
            pass_fds = (*fds, info_w)
        else:
            info_r = info_w = None
            argv = [*iso["argv"], iso["python"]]
            uid = None  # unshare -S/-G drops to nobody itself
            pass_fds = fds
            if iso["user_nobody"]:
                os.chown(cwd, _NOBODY, _NOBODY)
        prefix = _spawn_prefix(limits, uid)
        self._info_fd = None
        try:
            self.proc = subprocess.Popen(
                [*(prefix or []), *argv, "-I", program_path(script, iso), *map(str, fds)],
                cwd=cwd,
                env={"PATH": "/usr/bin:/bin", "HOME": str(cwd), "LANG": "C.UTF-8"},
                stdin=subprocess.PIPE,
                stdout=files["stdout"],
                stderr=files["stderr"],
                pass_fds=pass_fds,
                preexec_fn=_limits(limits, uid) if prefix is None else None,
                start_new_session=True,
            )
        except BaseException:
            for fd in (info_r, info_w):
                if fd is not None:
                    os.close(fd)
            raise
        self._info_fd = info_r
        if info_w is not None:
            os.close(info_w)

    def started(self) -> None:
        """Wait for bubblewrap to report its namespace's init (the pid :meth:`kill` kills), and move
        that init into the sandbox's cgroup: what it starts from then on is born inside. Called
        after both sandboxes are spawned, so that their set-ups overlap, and before the program is
        fed, so nothing of the program runs outside. (Namespaces made inside a memory cgroup made
        each judged answer 10 ms slower; the interpreter's start-up stays charged outside.)"""
        if self._info_fd is not None:
            fd, self._info_fd = self._info_fd, None
            self.info = _read_info(fd)
            if self.cgroup is not None:
                child = (self.info or {}).get("child-pid")
                if not child:
                    raise OSError(errno.ESRCH, "the sandbox reported no process to confine")
                self.cgroup.add(int(child))

    def _close_info(self) -> None:
        """Read what bubblewrap reported, if :meth:`started` did not (the pid to kill)."""
        if self._info_fd is not None:
            fd, self._info_fd = self._info_fd, None
            self.info = _read_info(fd)

    def feed(self, data: bytes) -> None:
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.close()
        except OSError:
            pass

    def kill(self) -> int:
        self._close_info()
        if self.proc.poll() is not None:
            return self.proc.returncode
        child = (self.info or {}).get("child-pid")
        if child:
            try:  # the namespace's init: the kernel kills every process of the namespace with it
                os.kill(child, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:  # bwrap reaps its init, then exits: no orphan left to the machine's init to reap
                return self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return self.proc.wait()


def _read_info(fd: int) -> dict | None:
    data = b""
    try:
        while chunk := os.read(fd, 4096):
            data += chunk
            if b"}" in data:
                break
    finally:
        os.close(fd)
    try:
        return json.loads(data[: data.index(b"}") + 1])
    except ValueError:
        return None


def run_sandboxed(
    program: str,
    tests: list[str],
    setup: str = "",
    limits: SandboxLimits | None = None,
    test_setup: str = "",
    weak_sandbox_ok: bool = False,
    may_shadow: tuple[str, ...] = (),
    imports: dict[str, tuple[str, str | None]] | None = None,
) -> tuple[SandboxResult, dict | None]:
    """Run ``program`` then ``setup`` in the candidate's sandbox and ``tests`` (after
    ``test_setup``, which only the tester sees) in the tester's, where the program's names are
    bound where the tests use them — except those that would shadow a builtin, unless ``may_shadow``
    names them (the functions the task asks for: MBPP's ``sum``) — and ``imports`` (the task's own:
    name -> (module, attribute or None), :func:`task_imports`) bound over them; returns the candidate's process result
    and the tester's count (``passed``, ``total``, ``errors``, and
    ``crash``/``gone``/``timeout``/``setup_error`` when they apply), or None when the tester gave
    nothing readable."""
    limits = limits or SandboxLimits()
    iso = isolation()
    if iso["kind"] != "bubblewrap" and not weak_sandbox_ok:
        raise SandboxUnavailable(
            "the code judge needs bubblewrap (apt-get install bubblewrap; make setup installs it) and it cannot "
            "run here; set weak_sandbox_ok: true in the code judge's settings to accept the weaker fallback"
        )
    with _SLOTS:  # the wall limit starts when the program gets a slot, not while it queues for one
        return _run(program, tests, setup, limits, test_setup, may_shadow, imports or {}, iso)


# Programs judged at once, across threads: an answering stage judges each answer as it finishes, up to
# its ``parallel`` in flight, and that many sandboxes sharing 2 cores would spend their wall limits
# waiting for a core.
_SLOTS = threading.BoundedSemaphore(max(2, os.cpu_count() or 2))


def _run(program, tests, setup, limits: SandboxLimits, test_setup, may_shadow, imports, iso: dict):
    work = Path(tempfile.mkdtemp(prefix="kibidango-judge-"))
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    started = time.monotonic()
    candidate = tester = None
    own = ExitStack()  # the sandboxes' leased uids and cgroups, given back last
    try:
        (work / "candidate").mkdir()
        (work / "tester").mkdir()
        uids, groups = [None, None], [None, None]
        if iso["kind"] == "bubblewrap" and iso.get("own_uid"):
            uids = [own.enter_context(UidLease()) for _ in range(2)]
        support = cgroup_support() if iso.get("cgroup") else None
        if support is not None:  # the candidate's: the tester runs the task's own code, as a uid of its own
            groups[0] = Cgroup(support, limits.memory_bytes, limits.processes)
            own.callback(groups[0].remove)
        files = {k: open(work / f"{k}.txt", "wb") for k in ("stdout", "stderr", "tester_stdout", "tester_stderr")}
        cwd = work / "candidate"
        candidate = _Sandboxed(sandbox.CANDIDATE, (req_r, resp_w), limits, iso, files, cwd, uids[0], groups[0])
        os.close(req_r)
        os.close(resp_w)
        req_r = resp_w = -1
        tester_files = {"stdout": files["tester_stdout"], "stderr": files["tester_stderr"]}
        tester = _Sandboxed(
            sandbox.TESTER, (req_w, resp_r), limits, _tester_iso(iso), tester_files, work / "tester", uids[1], groups[1]
        )
        candidate.started()
        tester.started()
        os.close(req_w)
        os.close(resp_r)
        req_w = resp_r = -1
        for f in files.values():
            f.close()
        candidate.feed((json.dumps({"program": program, "setup": setup}) + "\n").encode())
        spec = {
            "tests": list(tests),
            "setup": test_setup,
            "wall": limits.wall_seconds,
            "may_shadow": list(may_shadow),
            "wanted": sorted(_names_used([*tests, test_setup])),
            "modules": imports,
        }
        tester.feed(json.dumps(spec).encode())
        status = "exited"
        try:
            tester.proc.wait(timeout=limits.wall_seconds + 10)  # its own deadline ends it first
        except subprocess.TimeoutExpired:
            status = "timeout"
        tester.kill()
        returncode = candidate.proc.poll()
        candidate.kill()
        seconds = time.monotonic() - started
        counts = _read_counts((work / "tester_stdout.txt").read_bytes()[: codec.MAX_MESSAGE])
        if counts is not None and counts.get("timeout"):
            status = "timeout"
        stdout = (work / "stdout.txt").read_bytes()[: limits.output_chars * 4].decode("utf-8", "replace")
        stderr = (work / "stderr.txt").read_bytes()[: limits.output_chars * 4].decode("utf-8", "replace")
        if counts is None:
            stderr += (work / "tester_stderr.txt").read_bytes()[-2000:].decode("utf-8", "replace")
        where = {k: iso.get(k) for k in ("kind", "network_namespace", "user_nobody", "own_uid", "cgroup", "python")}
        result = SandboxResult(
            status, returncode, stdout[: limits.output_chars], stderr[: limits.output_chars], seconds, where
        )
        if groups[0] is not None:
            result.peak_memory_bytes, result.oom_kills = groups[0].peak_bytes(), groups[0].oom_kills()
        return result, counts
    finally:
        for proc in (tester, candidate):
            if proc is not None:
                proc.kill()
        for fd in (req_r, req_w, resp_r, resp_w):
            if fd >= 0:
                os.close(fd)
        own.close()
        shutil.rmtree(work, ignore_errors=True)


def _tester_iso(iso: dict) -> dict:
    """The tester runs trusted test code; in the fallback it needs no namespace of its own."""
    return iso if iso["kind"] == "bubblewrap" else {**iso, "argv": [], "user_nobody": False}


def _read_counts(data: bytes) -> dict | None:
    """The tester's count, or None for anything malformed (never an exception)."""
    lines = data.decode("utf-8", "replace").strip().splitlines()
    try:
        counts = json.loads(lines[-1]) if lines else None
    except (ValueError, RecursionError):
        return None
    if not isinstance(counts, dict):
        return None
    ok = (
        isinstance(counts.get("passed"), int)
        and isinstance(counts.get("total"), int)
        and isinstance(counts.get("errors"), list)
        and 0 <= counts["passed"] <= counts["total"]
    )
    return counts if ok else None


def judged_program(task: Task, answer: str) -> str:
    """The program the code judge runs for ``answer`` to ``task``: the answer's code as
    :func:`methods.judges.extract.extract_program` finds it, for the names the task calls
    (HumanEval's entry point, or the reference's functions its tests use)."""
    tests = [f"check({task.entry_point})"] if task.entry_point else list(task.tests)
    used = _names_used(tests)
    entry = (task.entry_point,) if task.entry_point else tuple(n for n in _defined_names(task.reference) if n in used)
    return extract_program(answer, entry, task.prompt if task.entry_point else "")


@dataclass
class CodeJudge:
    """Runs the answer's program against ``task.tests`` (MBPP: assert statements) or HumanEval's
    ``check`` (one test: ``check(entry_point)`` after the check function's definition, which only
    the tester sees). ``weak_sandbox_ok``: judge code without bubblewrap (see the module)."""

    wall_seconds: float = 10.0
    cpu_seconds: int = 5
    memory_mb: int = 1024
    weak_sandbox_ok: bool = False
    attempts: int = 3
    """Runs of one answer when the sandbox itself failed (it could not start, the tester gave
    nothing readable): such a verdict is the machine's, never the answer's; after the last
    attempt it is a ``judge_error`` with ``details["infrastructure"]``, which the stages count
    apart from failures."""
    kind: str = "code"

    def __call__(self, task: Task, answer: str) -> Verdict:
        started = time.monotonic()
        if not task.tests:
            return Verdict(False, 0.0, f"task {task.id} has no tests", "judge_error", 0.0)
        tests, test_setup = list(task.tests), ""
        if task.entry_point:  # HumanEval: the check function (the tester's alone), then one call of it
            test_setup = "\n".join(tests)
            tests = [f"check({task.entry_point})"]
        program = judged_program(task, answer)
        if why := format_failure(program):  # nothing to run: the answer's format, not its logic, failed
            details = {"format_failure": why, "attempts": 0}
            return Verdict(False, 0.0, f"error: {why}", "error", time.monotonic() - started, details)
        limits = SandboxLimits(
            wall_seconds=self.wall_seconds, cpu_seconds=self.cpu_seconds, memory_bytes=self.memory_mb << 20
        )
        shadow = _defined_names(task.reference) + ((task.entry_point,) if task.entry_point else ())
        imports = task_imports(task.reference, task.prompt, task.setup)
        for attempt in range(1, max(1, self.attempts) + 1):
            try:
                result, counts = run_sandboxed(
                    program, tests, task.setup, limits, test_setup, self.weak_sandbox_ok, shadow, imports
                )
            except OSError as e:  # a sandbox could not be made (no uid, no cgroup, no process left)
                verdict = Verdict(False, 0.0, f"judge error: the sandbox could not start ({e})", "judge_error")
                verdict.details["infrastructure"] = True
            else:
                verdict = self._verdict(result, counts)
            verdict.details["attempts"] = attempt
            if not verdict.details.get("infrastructure"):
                break
            verdict.details["retryable"] = True  # a later run judges it again
            if attempt < self.attempts:
                log.warning(f"task {task.id}: {verdict.reason}; judging it again (attempt {attempt + 1})")
                time.sleep(0.25 * 2**attempt)
        return dataclasses.replace(verdict, cost=time.monotonic() - started)

    def _verdict(self, result: SandboxResult, counts: dict | None) -> Verdict:
        details = {"isolation": result.isolation, "seconds": round(result.seconds, 3), "returncode": result.returncode}
        if result.peak_memory_bytes is not None:
            details["peak_memory_mb"] = round(result.peak_memory_bytes / (1 << 20), 1)
        # SIGXCPU at the soft CPU limit; SIGKILL at the hard one (a program that replaced the handler)
        cpu = result.returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU) or (
            result.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL) and result.seconds >= self.cpu_seconds
        )
        if result.status == "timeout" or (cpu and (counts is None or counts["passed"] < counts["total"])):
            limit = "CPU" if cpu else "wall"
            return Verdict(False, 0.0, f"timeout: the {limit} limit was reached", "timeout", 0.0, details)
        if result.oom_kills:
            reason = (
                f"error: the program passed the sandbox's memory limit ({self.memory_mb} MB for all its processes "
                f"together): {result.oom_kills} process(es) killed"
            )
            return Verdict(False, 0.0, reason, "error", 0.0, details)
        if counts is None:
            why = _last_error(result.stderr) or "no readable result"
            reason = f"judge error: the tester gave no readable result ({why})"
            return Verdict(False, 0.0, reason, "judge_error", 0.0, {**details, "infrastructure": True})
        if "crash" in counts:
            return Verdict(False, 0.0, f"error: {counts['crash']}", "error", 0.0, details)
        if "setup_error" in counts:
            reason = f"judge error: the task's test setup failed: {counts['setup_error']}"
            return Verdict(False, 0.0, reason, "judge_error", 0.0, details)
        passed, total = counts["passed"], counts["total"]
        if "gone" in counts and passed < total:
            why = _last_error(result.stderr) or f"status {result.returncode}"
            score = passed / total if total else 0.0
            return Verdict(False, score, f"error: {counts['gone']} ({why})", "error", 0.0, details)
        score = passed / total if total else 0.0
        if passed == total:
            return Verdict(True, 1.0, f"all {total} tests passed", "passed", 0.0, details)
        first = str(counts["errors"][0]) if counts["errors"] else "no detail"
        return Verdict(False, score, f"{passed}/{total} tests passed; {first}", "failed", 0.0, details)


def _names_used(sources: list[str]) -> set[str]:
    """Every name the tests (and their setup) use: the only names the tester binds. A name one
    of them assigns locally is harmless to bind as well; a source that does not parse uses none."""
    names: set[str] = set()
    for source in sources:
        try:
            tree = parse(source)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue
        names.update(node.id for node in ast.walk(tree) if isinstance(node, ast.Name))
    return {n for n in names if not n.startswith("__")}


def task_imports(*sources: str) -> dict[str, tuple[str, str | None]]:
    """The top-level imports of a task's own code (its reference solution, prompt, setup): name ->
    (module, attribute or None). The tester binds them itself, so a test that uses ``math`` gets
    the standard library's, whatever the program sent. A source that does not parse as a whole (a
    HumanEval prompt ends in a bare signature) is read line by line."""
    out: dict[str, tuple[str, str | None]] = {}
    for source in sources:
        try:
            body = parse(source).body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            body = []
            for line in source.splitlines():
                if re.match(r"(import|from)\s", line):
                    try:
                        body += parse(line).body
                    except (SyntaxError, ValueError):
                        continue
        for node in body:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    top = alias.name.split(".")[0]
                    out[alias.asname or top] = (alias.name if alias.asname else top, None)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    if alias.name != "*":
                        out[alias.asname or alias.name] = (node.module, alias.name)
    return out


def _defined_names(reference: str) -> tuple[str, ...]:
    """The top-level functions and classes of a task's reference solution: the names the task asks
    the program to define, which it may do even where they are builtins' names."""
    try:
        tree = parse(reference)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return ()
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return tuple(node.name for node in tree.body if isinstance(node, kinds))


def _last_error(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""

"""The tester's process: the task's tests, with the program's names bound to proxies that call
into the candidate's sandbox; prints its count as one JSON line (``passed``, ``total``,
``errors``, and ``crash`` / ``gone`` / ``timeout`` / ``setup_error`` when they apply).

Run by path in its sandbox: ``python -I tester.py <write fd> <read fd>``, its spec (tests, setup,
the names the tests use, the task's imports, the wall limit) as JSON on stdin. Standard library
only.
"""

from __future__ import annotations

import builtins
import importlib
import json
import os
import sys
import time

if not __package__:  # run by path: -I leaves this folder off sys.path, and the codec is beside it
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from codec import Reader, dec, enc, send
else:  # imported (the tests)
    from .codec import Reader, dec, enc, send


class Handle:
    """An object of the candidate's that is not plain data: it can only be passed back."""

    def __init__(self, n, kind):
        self.n, self.kind = n, kind

    def __repr__(self):
        return f"<{self.kind} object in the sandbox>"


class Gone(BaseException):
    """The candidate is gone or unreadable: no test after this can pass (not catchable as Exception)."""


def leaf(x):
    if isinstance(x, Handle):
        return {"h": x.n}
    raise TypeError(f"a {type(x).__name__} value cannot be passed into the sandbox (plain data only)")


class Handles:
    def __init__(self):
        self.seen = {}

    def __call__(self, x):
        n = int(x["h"])
        if n not in self.seen:
            self.seen[n] = Handle(n, str(x.get("type", "object"))[:100])
        return self.seen[n]


def reraise(name, message):
    """The candidate's exception, as a builtin exception of the same name where there is one."""
    kind = getattr(builtins, str(name), None)
    error = None
    if isinstance(kind, type) and issubclass(kind, Exception) and kind.__module__ == "builtins":
        try:
            error = kind(message)
        except Exception:
            pass
    raise error if error is not None else RuntimeError(f"{name}: {message}")


class Candidate:
    """The pipe to the candidate's process: proxies of its names, and why it is gone (if it is)."""

    def __init__(self, wfd: int, rfd: int, deadline: float):
        self.wfd, self.replies, self.deadline = wfd, Reader(rfd), deadline
        self.unleaf = Handles()
        self.gone = None

    def ready(self):
        return self.replies.recv(self.deadline)

    def proxy(self, name):
        def call(*args, **kwargs):
            if self.gone:
                raise Gone(self.gone)
            request = {
                "call": name,
                "args": [enc(a, leaf) for a in args],
                "kwargs": {k: enc(v, leaf) for k, v in kwargs.items()},
            }
            try:
                send(self.wfd, request)
                reply = self.replies.recv(self.deadline)
            except OSError:
                reply = None
            if reply == "timeout":
                self.gone = "timeout"
            elif reply is None:
                self.gone = "the program ended while its tests ran"
            elif reply == "malformed" or not ({"ok", "raise"} & set(reply)):
                self.gone = "the program sent an unreadable reply"
            if self.gone:
                raise Gone(self.gone)
            if "ok" in reply:
                try:
                    return dec(reply["ok"], self.unleaf)
                except Exception:
                    self.gone = "the program sent an unreadable value"
                    raise Gone(self.gone) from None
            reraise(reply.get("raise"), reply.get("message", ""))

        call.__name__ = call.__qualname__ = name
        return call


def namespace(spec: dict, got, candidate: Candidate) -> dict | None:
    """The tests' namespace, or None for an unreadable reply. It is the task's: a name is bound
    only where the tests use it (``wanted``, read from the tests by the judge), never a dunder,
    never one that would shadow a builtin unless the task defines that name itself; the
    candidate's message can only fill those names. A module the program imported is bound under
    its own name (``import math``), and the task's own imports (its reference's, its prompt's) are
    bound last, from this sandbox's standard library."""
    ns = {"__name__": "__main__"}
    want, shadow = set(spec["wanted"]), set(spec["may_shadow"])

    def own(k):
        return isinstance(k, str) and k in want and not k.startswith("__") and (k in shadow or not hasattr(builtins, k))

    shape = (
        isinstance(got, dict)
        and isinstance(got.get("callables"), list)
        and isinstance(got.get("values"), dict)
        and isinstance(got.get("modules", {}), dict)
    )
    if not shape:
        return None
    for k in got["callables"]:
        if own(k):
            ns[k] = candidate.proxy(k)
    for k, v in got["values"].items():
        if own(k):
            try:
                ns[k] = dec(v, candidate.unleaf)
            except Exception:
                pass
    for k, m in got.get("modules", {}).items():
        if own(k) and m == k:
            try:
                ns[k] = importlib.import_module(k)
            except Exception:
                pass
    for k, (m, attr) in spec["modules"].items():
        if own(k):
            try:
                v = importlib.import_module(m)
                if attr is not None:
                    v = getattr(v, attr) if hasattr(v, attr) else importlib.import_module(m + "." + attr)
                ns[k] = v
            except Exception:
                ns.pop(k, None)
    return ns


def run_tests(spec: dict, ns: dict, candidate: Candidate, result: dict) -> None:
    try:
        if spec["setup"]:
            exec(compile(spec["setup"], "test_setup.py", "exec"), ns)
    except Gone as e:
        result["gone"] = str(e)
        return
    except BaseException as e:
        result["setup_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        return
    for i, test in enumerate(spec["tests"]):
        try:
            exec(compile(test, f"test_{i}.py", "exec"), ns)
            result["passed"] += 1
        except Gone as e:
            result["errors"].append(f"test {i}: {e}")
        except BaseException as e:
            result["errors"].append(f"test {i}: {type(e).__name__}: {str(e)[:200]}")
    if candidate.gone == "timeout":
        result["timeout"] = True
    elif candidate.gone:
        result["gone"] = candidate.gone


def main(argv: list[str]) -> None:
    wfd, rfd = int(argv[1]), int(argv[2])
    spec = json.loads(sys.stdin.read())
    candidate = Candidate(wfd, rfd, time.monotonic() + spec["wall"])
    result = {"passed": 0, "total": len(spec["tests"]), "errors": []}
    ready = candidate.ready()
    if ready == "timeout":
        result["timeout"] = True
    elif ready is None:
        result["gone"] = "the program ended before its tests ran"
    elif ready == "malformed" or not ({"ready", "crash"} & set(ready)):
        result["gone"] = "the program sent an unreadable reply"
    elif "crash" in ready:
        result["crash"] = str(ready["crash"])[:400]
    else:
        ns = namespace(spec, ready["ready"], candidate)
        if ns is None:
            result["gone"] = "the program sent an unreadable reply"
        else:
            run_tests(spec, ns, candidate, result)
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv)

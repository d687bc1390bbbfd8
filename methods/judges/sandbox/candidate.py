"""The candidate's process: run the answer's program (then the task's setup), tell the tester its
names, then answer the tester's calls until it closes the pipe.

Run by path in its sandbox: ``python -I candidate.py <read fd> <write fd>``, the program and setup
as one JSON line on stdin. The audit hook is a tripwire for clearer errors (and the only guard in
the weaker fallback); bubblewrap is the wall. Standard library only.
"""

from __future__ import annotations

import json
import os
import signal
import sys

if not __package__:  # run by path: -I leaves this folder off sys.path, and the codec is beside it
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from codec import Reader, dec, enc, send
else:  # imported (the tests)
    from .codec import Reader, dec, enc, send

BLOCKED = frozenset(
    {
        "os.fork",
        "os.forkpty",
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "subprocess.Popen",
        "os.kill",
        "os.killpg",
        "socket.connect",
        "socket.bind",
        "socket.sendto",
        "socket.sendmsg",
        "ctypes.dlopen",
        "ctypes.dlsym",
        "ctypes.cdata",
        "ctypes.call_function",
    }
)
"""Audit events the program may not raise."""
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def tripwire(root: str):
    """The audit hook: no event of :data:`BLOCKED`, no file opened for writing outside ``root``."""

    def hook(event, args):
        if event in BLOCKED:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open" and args and not isinstance(args[0], int):
            mode, flags = (args + (None, 0))[1:3]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & _WRITE)
            if writing and not os.path.realpath(os.fsdecode(args[0])).startswith(root + os.sep):
                raise PermissionError(f"sandbox: writing outside the sandbox is not allowed: {os.fsdecode(args[0])}")

    return hook


def names(ns: dict, leaf) -> dict:
    """What the tester may bind of the program's namespace: its callables (a class too: its
    instances come back as handles), its plain values (the setup's objects cross as handles) and
    the modules it imported."""
    callables, values, modules = [], {}, {}
    for k, v in list(ns.items()):
        if k.startswith("__"):
            continue
        if type(v).__name__ == "module":
            modules[k] = str(getattr(v, "__name__", ""))
        elif callable(v):
            callables.append(k)
        elif not hasattr(type(v), "__next__"):
            try:
                values[k] = enc(v, leaf)
            except Exception:
                pass
    return {"callables": callables, "values": values, "modules": modules}


def main(argv: list[str]) -> None:
    # PID 1 of its namespace ignores a signal it has no handler for: the CPU limit's SIGXCPU ends it here
    signal.signal(signal.SIGXCPU, lambda *_: os._exit(128 + signal.SIGXCPU))
    rfd, wfd = int(argv[1]), int(argv[2])
    spec = json.loads(sys.stdin.readline())
    sys.stdin.close()
    sys.addaudithook(tripwire(os.path.realpath(os.getcwd())))
    objs = []

    def leaf(x):  # an object that is not plain data stays here; the tester gets a handle to pass back
        objs.append(x)
        return {"h": len(objs) - 1, "type": type(x).__name__[:100]}

    def unleaf(x):
        return objs[int(x["h"])]

    ns = {"__name__": "__main__"}
    try:
        exec(compile(spec["program"], "candidate.py", "exec"), ns)
        if spec["setup"]:
            exec(compile(spec["setup"], "setup.py", "exec"), ns)
    except BaseException as e:
        sys.stdout.flush()
        send(wfd, {"crash": f"{type(e).__name__}: {str(e)[:300]}"})
        os._exit(1)
    sys.stdout.flush()
    send(wfd, {"ready": names(ns, leaf)})
    calls = Reader(rfd)
    while True:
        req = calls.recv(None)
        if not isinstance(req, dict):
            os._exit(0)
        try:
            args = [dec(a, unleaf) for a in req["args"]]
            kwargs = {str(k): dec(v, unleaf) for k, v in req["kwargs"].items()}
            out = {"ok": enc(ns[req["call"]](*args, **kwargs), leaf)}
        except BaseException as e:
            out = {"raise": type(e).__name__, "message": str(e)[:300]}
        sys.stdout.flush()
        send(wfd, out)


if __name__ == "__main__":
    main(sys.argv)

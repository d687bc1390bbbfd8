"""Values cross between the candidate's and the tester's sandboxes by value, as one JSON line each:
plain data (numbers, strings, bytes, containers, iterators drained, builtin types) is encoded and
decoded into builtins; anything else is a *leaf* the sending side turns into a handle
(``leaf(x)``) and the receiving side resolves (``unleaf(x)``). Standard library only: this module
runs inside both sandboxes."""

from __future__ import annotations

import builtins
import json
import os
import select
import time

MAX_MESSAGE = 4 << 20
"""Bytes of one value crossing between the sandboxes, as JSON."""
MAX_DEPTH = 200
MAX_ITEMS = 100_000
"""Items of an iterator drained to cross."""


def enc(x, leaf, depth: int = 0):
    """``x`` as JSON-able data; ``leaf(x)`` for what is not plain data."""
    if depth > MAX_DEPTH:
        raise ValueError("a value nested too deeply to leave the sandbox")
    if x is None or x is True or x is False:
        return x
    if isinstance(x, int):
        return {"i": str(int(x))}
    if isinstance(x, float):
        return {"f": repr(float(x))}
    if isinstance(x, complex):
        return {"c": [repr(x.real), repr(x.imag)]}
    if isinstance(x, str):
        return str.__str__(x)
    if isinstance(x, (bytes, bytearray)):
        return {"bytearray" if isinstance(x, bytearray) else "b": bytes(x).hex()}
    if isinstance(x, (list, tuple, set, frozenset)):
        tag = "l" if isinstance(x, list) else "t" if isinstance(x, tuple) else "s" if isinstance(x, set) else "fs"
        return {tag: [enc(v, leaf, depth + 1) for v in x]}
    if isinstance(x, dict):
        return {"d": [[enc(k, leaf, depth + 1), enc(v, leaf, depth + 1)] for k, v in x.items()]}
    if isinstance(x, range):
        return {"r": [x.start, x.stop, x.step]}
    if hasattr(type(x), "__next__") and hasattr(type(x), "__iter__"):
        items = []
        for v in x:
            items.append(enc(v, leaf, depth + 1))
            if len(items) > MAX_ITEMS:
                raise ValueError("an iterator too long to leave the sandbox")
        return {"it": items}
    if isinstance(x, type) and getattr(builtins, x.__name__, None) is x:
        return {"type": x.__name__}
    return leaf(x)


_KINDS = {"l": list, "t": tuple, "s": set, "fs": frozenset, "it": iter}


def dec(x, unleaf):
    """What :func:`enc` encoded, as builtins; ``unleaf(x)`` for a handle. ValueError for anything
    malformed."""
    if x is None or isinstance(x, (bool, str)):
        return x
    if not isinstance(x, dict) or not x:
        raise ValueError("malformed value")
    if "h" in x:
        return unleaf(x)
    if len(x) != 1:
        raise ValueError("malformed value")
    ((tag, v),) = x.items()
    if tag == "i":
        return int(v)
    if tag == "f":
        return float(v)
    if tag == "c":
        return complex(float(v[0]), float(v[1]))
    if tag == "b":
        return bytes.fromhex(v)
    if tag == "bytearray":
        return bytearray.fromhex(v)
    if tag in _KINDS:
        return _KINDS[tag]([dec(i, unleaf) for i in v])
    if tag == "d":
        return {dec(k, unleaf): dec(w, unleaf) for k, w in v}
    if tag == "r":
        return range(int(v[0]), int(v[1]), int(v[2]))
    if tag == "type" and isinstance(getattr(builtins, str(v), None), type):
        return getattr(builtins, str(v))
    raise ValueError(f"malformed value tag {tag!r}")


def send(fd: int, obj) -> None:
    """``obj`` as one JSON line on ``fd``; a line over :data:`MAX_MESSAGE` becomes the error the
    other side raises."""
    data = (json.dumps(obj) + "\n").encode()
    if len(data) > MAX_MESSAGE:
        too_large = {"raise": "ValueError", "message": "a value too large to leave the sandbox"}
        data = (json.dumps(too_large) + "\n").encode()
    while data:
        data = data[os.write(fd, data) :]


class Reader:
    """JSON lines from ``fd``."""

    def __init__(self, fd: int):
        self.fd = fd
        self.buf = bytearray()

    def recv(self, deadline: float | None):
        """One JSON object; None at end of stream; ``"timeout"`` past ``deadline`` (monotonic
        seconds); ``"malformed"`` for anything else."""
        while b"\n" not in self.buf:
            if len(self.buf) > MAX_MESSAGE:
                return "malformed"
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and (left <= 0 or not select.select([self.fd], [], [], left)[0]):
                return "timeout"
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                return None
            self.buf += chunk
        line, _, rest = bytes(self.buf).partition(b"\n")
        self.buf = bytearray(rest)
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):
            return "malformed"
        return obj if isinstance(obj, dict) else "malformed"

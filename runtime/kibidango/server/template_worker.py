"""The process that renders bundles' chat templates (``python -m kibidango.server.template_worker``).

A chat template is code that came with a bundle; the server never runs it in its own process
(:mod:`kibidango.server.chat_template` sends it here). This process renders one request at a time
in a Jinja sandbox like transformers' own (immutable, the same ``tojson``, ``raise_exception``,
``strftime_now`` and loop controls) with bounds transformers does not set:

- ``*`` and ``**`` whose result would pass ``max_chars`` (a string, a list, a power) are refused;
- a call with an integer argument over ``max_chars`` (``'x'.ljust(10**10)``) is refused;
- ``range`` yields at most ``max_range`` numbers;
- the output stops at ``max_chars`` characters;
- rendering stops after ``seconds`` (a trace function checks the clock: a loop that prints
  nothing is stopped too);
- and, what no check on values can do, its address space is capped (``RLIMIT_AS``: what it held
  at start plus ``--memory-mb``): ``(['x'.center(1000000)] * 600) | join`` passes every bound on
  items, allocates 600 MB in one C call the clock cannot interrupt — and here gets a MemoryError.
  The server kills the process when a render outlives its time, and starts another.

Protocol: one JSON request per line on stdin (``template``, ``context``, ``seconds``,
``max_chars``, ``max_range``), one JSON reply per line on stdout: ``{"text": ...}`` or
``{"error": ..., "bound": true|false}``.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from functools import lru_cache

from kibidango.addons.chat_template import chat_environment


class _Bound(Exception):
    """A render went past a bound."""


@lru_cache(maxsize=8)
def _compile(template: str, max_chars: int, max_range: int):
    from jinja2.exceptions import SecurityError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def too_big(n) -> bool:
        return isinstance(n, int) and not isinstance(n, bool) and abs(n) > max_chars

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**"])

        def call_binop(self, context, operator, left, right):
            if operator == "**" and isinstance(left, int | float) and isinstance(right, int | float):
                if abs(right) > 64 and abs(left) > 1:
                    raise SecurityError(f"the power {left!r} ** {right!r} is larger than this server renders")
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, str | list | tuple | bytes) and isinstance(n, int) and len(seq) * n > max_chars:
                        raise SecurityError(f"a value of {len(seq) * n:,} items is larger than this server renders")
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's own signature
            if any(too_big(a) for a in (*args, *kwargs.values())):
                raise SecurityError("a call with an argument larger than this server renders")
            return super().call(__context, __obj, *args, **kwargs)

    def bounded_range(*args):
        r = range(*args)
        if len(r) > max_range:
            raise SecurityError(f"range of {len(r):,} numbers; this server renders at most {max_range:,}")
        return r

    env = chat_environment(Bounded)
    env.globals["range"] = bounded_range
    return env.from_string(template)


def render(request: dict, memory_mb: int) -> dict:
    """One request's reply (see the module)."""
    from jinja2.exceptions import SecurityError, TemplateError

    seconds, max_chars = float(request["seconds"]), int(request["max_chars"])
    try:
        template = _compile(request["template"], max_chars, int(request["max_range"]))
    except TemplateError as e:
        return {"error": f"the bundle's chat template does not compile: {e}", "bound": False}
    deadline = time.monotonic() + seconds

    def trace(frame, event, arg):
        if time.monotonic() > deadline:
            raise TimeoutError
        return trace

    out: list[str] = []
    size = 0
    sys.settrace(trace)
    try:
        for piece in template.generate(**request["context"]):
            size += len(piece)
            if size > max_chars:
                raise _Bound(f"the bundle's chat template made more than {max_chars:,} characters")
            out.append(piece)
    except _Bound as e:
        return {"error": str(e), "bound": True}
    except TimeoutError:
        return {"error": f"the bundle's chat template took more than {seconds:g} s to render", "bound": True}
    except MemoryError:
        out.clear()
        return {"error": f"the bundle's chat template needed more than {memory_mb:,} MB to render", "bound": True}
    except SecurityError as e:
        return {"error": f"the bundle's chat template went past this server's bounds: {e}", "bound": True}
    except TemplateError as e:
        return {"error": f"the bundle's chat template refused this conversation: {e}", "bound": False}
    except (RecursionError, OverflowError, TypeError, ValueError, AttributeError, KeyError, IndexError) as e:
        return {"error": f"the bundle's chat template failed: {type(e).__name__}", "bound": False}
    finally:
        sys.settrace(None)
    return {"text": "".join(out)}


def _cap_memory(memory_mb: int) -> None:
    """The address space this process holds now, plus ``memory_mb``."""
    with open("/proc/self/statm") as f:
        held = int(f.read().split()[0]) * resource.getpagesize()
    limit = held + (memory_mb << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def main() -> None:
    parser = argparse.ArgumentParser(prog="kibidango.server.template_worker")
    parser.add_argument("--memory-mb", type=int, default=256)
    args = parser.parse_args()
    import jinja2.sandbox  # noqa: F401 - loaded before the cap: it is not the template's to pay for

    _cap_memory(args.memory_mb)
    for line in sys.stdin:
        try:
            reply = render(json.loads(line), args.memory_mb)
        except MemoryError:
            reply = {"error": f"the bundle's chat template needed more than {args.memory_mb:,} MB", "bound": True}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()

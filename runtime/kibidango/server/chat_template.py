"""A bundle's chat template, rendered within bounds.

The template is code that came with the bundle; a request's messages are data it runs on. The
server renders it (off its event loop) in a Jinja sandbox like transformers' own (immutable, the
same ``tojson``, ``raise_exception``, ``strftime_now`` and loop controls) with bounds transformers
does not set:

- ``*`` and ``**`` whose result would pass ``max_chars`` (a string, a list, a power) are refused;
- a call with an integer argument over ``max_chars`` (``'x'.ljust(10**10)``) is refused;
- ``range`` yields at most ``max_range`` numbers;
- the output stops at ``max_chars`` characters;
- rendering stops after ``seconds`` (a trace function on the rendering thread checks the clock:
  a loop that prints nothing is stopped too).

Past any bound: :class:`TemplateBoundError`, which the server answers with a clear 400.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from functools import lru_cache

__all__ = ["TemplateBoundError", "render_chat"]


class TemplateBoundError(ValueError):
    """The chat template went past a bound (time, size) or failed on this conversation."""


@lru_cache(maxsize=8)
def _compile(template: str, max_chars: int, max_range: int):
    import jinja2
    import jinja2.ext
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

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(
        range=bounded_range, raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f)
    )
    return env.from_string(template)


def render_chat(
    tokenizer,
    turns: list[dict[str, str]],
    seconds: float = 2.0,
    max_chars: int = 1 << 20,
    max_range: int = 10_000,
) -> str:
    """The prompt the tokenizer's chat template makes of ``turns`` (with the generation prompt),
    within the bounds above; call it on a worker thread (the time bound traces that thread)."""
    from jinja2.exceptions import SecurityError, TemplateError

    try:
        template = _compile(tokenizer.chat_template, max_chars, max_range)
    except TemplateError as e:
        raise TemplateBoundError(f"the bundle's chat template does not compile: {e}") from None
    context = {**getattr(tokenizer, "special_tokens_map", {}), "messages": turns, "add_generation_prompt": True}
    context.update(tools=None, documents=None)
    deadline = time.monotonic() + seconds

    def trace(frame, event, arg):
        if time.monotonic() > deadline:
            raise TimeoutError
        return trace

    out: list[str] = []
    size = 0
    previous = sys.gettrace()
    sys.settrace(trace)  # this thread only
    try:
        for piece in template.generate(**context):
            size += len(piece)
            if size > max_chars:
                raise TemplateBoundError(f"the bundle's chat template made more than {max_chars:,} characters")
            out.append(piece)
    except TimeoutError:
        raise TemplateBoundError(f"the bundle's chat template took more than {seconds:g} s to render") from None
    except SecurityError as e:
        raise TemplateBoundError(f"the bundle's chat template went past this server's bounds: {e}") from None
    except TemplateError as e:
        raise TemplateBoundError(f"the bundle's chat template refused this conversation: {e}") from None
    except (RecursionError, MemoryError, OverflowError) as e:
        raise TemplateBoundError(f"the bundle's chat template failed: {type(e).__name__}") from None
    finally:
        sys.settrace(previous)
    return "".join(out)

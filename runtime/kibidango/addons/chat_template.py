"""The Jinja environment chat templates are rendered in, as transformers renders them: an immutable
sandbox with ``trim_blocks``/``lstrip_blocks``, loop controls, transformers' ``tojson`` (no ASCII
escaping), ``raise_exception`` and ``strftime_now``. :mod:`kibidango.bundle.tokenizer` renders a
bundle's template with it in process; :mod:`kibidango.server.template_worker` subclasses the sandbox
with bounds and renders a client's turns apart."""

from __future__ import annotations

import json
from datetime import datetime


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def raise_exception(message: str):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def chat_environment(env_class=None):
    """A new environment of ``env_class`` (default: jinja2's ``ImmutableSandboxedEnvironment``)
    set up as transformers sets up its own for chat templates."""
    if env_class is None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment as env_class
    env = env_class(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env

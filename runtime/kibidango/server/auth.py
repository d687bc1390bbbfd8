"""ASGI middleware and keys: a body size limit checked before parsing, and Bearer API keys on
``/v1/`` compared in constant time (401 in OpenAI's shape; no key is ever logged or echoed)."""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` is refused (413) before it is parsed;
    the declared Content-Length is checked first, then the bytes as they arrive."""

    def __init__(self, app, max_bytes: int, on_refuse=lambda: None):
        self.app, self.max_bytes, self.on_refuse = app, max_bytes, on_refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            self.on_refuse()
            return await _send_error(
                send, 413, f"request body of {int(declared)} bytes exceeds this server's limit of {self.max_bytes}"
            )
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    from starlette.exceptions import HTTPException

                    raise HTTPException(413, f"request body exceeds this server's limit of {self.max_bytes} bytes")
            return message

        return await self.app(scope, counted, send)


async def _send_error(send, status: int, message: str, code: str | None = None, headers: tuple = ()) -> None:
    body = json.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    ).encode()
    head = [(b"content-type", b"application/json"), *headers]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


def key_scope(key: str) -> str:
    """What session memory is keyed by for a request made with ``key``: a digest, never the key."""
    return "key-" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:24]


class BearerAuth:
    """ASGI middleware: every ``/v1/`` request needs ``Authorization: Bearer <key>`` with one of
    ``keys`` (compared in constant time, every key each time), else 401 in OpenAI's error shape.
    ``/health`` and ``/metrics`` stay open (probes and scrapers). The request's scope carries
    :func:`key_scope` of its key; no key is ever logged or echoed."""

    def __init__(self, app, keys: list[str], on_refuse=lambda: None):
        self.app, self.on_refuse = app, on_refuse
        self.keys = [k.encode("utf-8") for k in keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        kind, _, token = header.partition(b" ")
        token = token.strip()
        ok = False
        for key in self.keys:
            ok |= hmac.compare_digest(token, key)
        if not (ok and kind.lower() == b"bearer"):
            self.on_refuse()
            message = (
                "Incorrect API key provided."
                if token
                else "You didn't provide an API key. You need to provide your API key in an Authorization header "
                "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
            )
            return await _send_error(send, 401, message, "invalid_api_key", ((b"www-authenticate", b"Bearer"),))
        scope.setdefault("state", {})["key_scope"] = key_scope(token.decode("utf-8", "replace"))
        return await self.app(scope, receive, send)


def load_api_keys(env: str | None = None, path: str | None = None) -> list[str]:
    """The server's API keys: from the environment variable ``env`` (comma-separated) and the
    file ``path`` (one per line, ``#`` comments). Errors name the variable or file and line, never
    a key."""
    import os

    keys: list[str] = []
    if env is not None:
        value = os.environ.get(env, "")
        if not value.strip():
            raise ValueError(f"--api-key-env {env}: the environment variable is not set or empty")
        keys += [k.strip() for k in value.split(",") if k.strip()]
    if path is not None:
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise ValueError(f"--api-keys-file {path}: cannot read it ({e.strerror})") from None
        for n, line in enumerate(lines, 1):
            line = line.strip()
            if line and not line.startswith("#"):
                if any(c.isspace() for c in line):
                    raise ValueError(f"--api-keys-file {path}: line {n} holds whitespace inside a key")
                keys.append(line)
        if not keys:
            raise ValueError(f"--api-keys-file {path}: no key in it")
    if any(len(key) < 16 for key in keys):
        raise ValueError(
            f"API keys from {key_sources(env, path)}: a key shorter than 16 characters (too easy to guess)"
        )
    return keys


def key_sources(env: str | None, path: str | None) -> str:
    return " and ".join(x for x in (f"${env}" if env else None, path) if x)


def is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

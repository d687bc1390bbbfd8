"""A fault-injecting HTTP proxy for tests: in front of a real OpenAI-compatible server on
127.0.0.1, it forwards requests and, per the script it is given, answers a request with a timeout
(forwarded, then held past the client's timeout: served, perhaps billed, never received), a 429
with Retry-After (``429``: 1 second; ``429-soon``: "soon", neither a number nor a date), a 500, a
reply whose JSON is cut in half, the server's real reply with its ``usage`` replaced
(``usage=<JSON>``, NaN allowed; ``usage=absent`` removes it), or padded with 64 MB of spaces
(``huge``: with its Content-Length; ``huge-unsized``: without one, ended by closing the connection).
It records every request it forwarded upstream (the server's requests: what a paid endpoint would
bill)."""

from __future__ import annotations

import hashlib
import json
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["FaultProxy"]


class FaultProxy:
    def __init__(self, upstream: str, hold_s: float = 3.0):
        """``upstream``: the server's base URL without ``/v1`` (``http://127.0.0.1:PORT``)."""
        self.upstream = upstream.rstrip("/")
        self.hold_s = hold_s
        self.faults: deque[str] = deque()
        self.forwarded: list[dict] = []  # {"model", "prompt_sha", "path"} per upstream request
        self.injected: list[str] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                proxy._handle(self, None)

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                proxy._handle(self, body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def script(self, *faults: str) -> None:
        """Faults for the next chat requests, in order: timeout, 429, 429-soon, 500, truncate, usage=<JSON>,
        huge, huge-unsized, ok."""
        with self._lock:
            self.faults.extend(faults)

    def prompts(self, model: str | None = None) -> list[str]:
        """Digests of the prompts forwarded upstream (to ``model``), one per request."""
        return [f["prompt_sha"] for f in self.forwarded if model is None or f["model"] == model]

    def _handle(self, handler: BaseHTTPRequestHandler, body: bytes | None) -> None:
        fault = "ok"
        if body is not None and handler.path.endswith("/chat/completions"):
            with self._lock:
                fault = self.faults.popleft() if self.faults else "ok"
                if fault != "ok":
                    self.injected.append(fault)
        if fault in ("429", "429-soon"):
            after = "1" if fault == "429" else "soon"
            return self._reply(handler, 429, b'{"error": {"message": "slow down"}}', {"Retry-After": after})
        if fault == "500":
            return self._reply(handler, 500, b'{"error": {"message": "injected failure"}}')
        status, data, ctype = self._forward(handler, body)
        if fault == "timeout":
            time.sleep(self.hold_s)  # served upstream; the client gave up
            handler.close_connection = True
            return None
        if fault == "truncate":
            data = data[: len(data) // 2]
        if fault.startswith("usage="):
            reply = json.loads(data)
            if fault == "usage=absent":
                reply.pop("usage", None)
            else:
                reply["usage"] = json.loads(fault.removeprefix("usage="))
            data = json.dumps(reply).encode()  # NaN stays NaN, as a careless provider might send it
        if fault.startswith("huge"):
            return self._huge(handler, status, data, sized=fault == "huge")
        return self._reply(handler, status, data, {"Content-Type": ctype})

    @staticmethod
    def _huge(handler: BaseHTTPRequestHandler, status: int, data: bytes, sized: bool) -> None:
        pad = b" " * (1 << 20)
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        if sized:
            handler.send_header("Content-Length", str(len(data) + 64 * len(pad)))
        handler.end_headers()
        handler.close_connection = True
        try:
            handler.wfile.write(data[:-1])
            for _ in range(64):
                handler.wfile.write(pad)
            handler.wfile.write(data[-1:])
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _forward(self, handler: BaseHTTPRequestHandler, body: bytes | None) -> tuple[int, bytes, str]:
        if body is not None:
            try:
                request = json.loads(body)
                prompt = json.dumps(request.get("messages"), sort_keys=True)
                with self._lock:
                    self.forwarded.append(
                        {
                            "model": request.get("model"),
                            "prompt_sha": hashlib.sha256(prompt.encode()).hexdigest(),
                            "path": handler.path,
                        }
                    )
            except json.JSONDecodeError:
                pass
        headers = {k: v for k, v in handler.headers.items() if k.lower() in ("authorization", "content-type")}
        req = urllib.request.Request(self.upstream + handler.path, data=body, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, r.read(), r.headers.get("Content-Type", "application/json")
        except urllib.error.HTTPError as e:
            return e.code, e.read(), e.headers.get("Content-Type", "application/json")

    @staticmethod
    def _reply(handler: BaseHTTPRequestHandler, status: int, data: bytes, headers: dict | None = None) -> None:
        handler.send_response(status)
        for k, v in {"Content-Type": "application/json", **(headers or {})}.items():
            handler.send_header(k, v)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        try:
            handler.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass

"""A real uvicorn server on 127.0.0.1, in a thread of the test, whose model is slowed down so
that a test can hold it busy: every forward pass sleeps ``delay`` seconds longer."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

from kibidango.decode.speculative import Decoder


class _SlowSession:
    def __init__(self, inner, delay: float):
        self._inner, self._delay = inner, delay

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def feed(self, tokens, first=0):
        time.sleep(self._delay)
        return self._inner.feed(tokens, first)


class SlowModel:
    """A real model whose every forward pass takes ``delay`` seconds longer."""

    def __init__(self, inner, delay: float):
        self.inner, self.delay = inner, delay
        self.name, self.vocab_size, self.context_length = inner.name, inner.vocab_size, inner.context_length

    def new_session(self):
        return _SlowSession(self.inner.new_session(), self.delay)

    def parameters(self) -> int:
        return self.inner.parameters()


def _slowed(forward, delay: float):
    def slow(feeds):
        time.sleep(delay)
        return forward(feeds)

    return slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, bundle, delay: float, stall_seconds: float = 120.0, grace_s: float = 2.0, **app_kw):
        import uvicorn

        from kibidango.pipeline import Pipeline
        from kibidango.server.app import create_app
        from kibidango.server.drain import uvicorn_server

        pipe = Pipeline.from_bundle(bundle, mode="ar")
        batching = app_kw.get("parallel", 1) > 1
        if delay and not batching:
            pipe.models = {name: SlowModel(m, delay) for name, m in pipe.models.items()}
            pipe.decoder = Decoder(pipe.models, pipe.decoder.ngram_table)
        self.pipe = pipe
        self.app = create_app(pipe, model_name="kibidango-tiny", stall_seconds=stall_seconds, **app_kw)
        if delay and batching:  # a batching server: every batched forward sleeps
            for tier in self.app.state.scheduler.batcher.tiers.values():
                tier.forward = _slowed(tier.forward, delay)
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, log_level="warning", timeout_graceful_shutdown=grace_s
        )
        self.server = uvicorn_server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)

    @property
    def scheduler(self):
        return self.app.state.scheduler

    def stop(self, timeout: float = 30) -> None:
        """What SIGTERM does (drain, then stop); waits up to ``timeout`` for the server to end."""
        self.server.handle_exit(signal.SIGTERM, None)
        self.thread.join(timeout)


def raw_request(port: int, path: str, body: dict) -> socket.socket:
    """Send a request on a raw socket and return the socket unread (the caller drops it)."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return s


def wait_for(predicate, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False

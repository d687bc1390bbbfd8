"""The server under clients that go away: a real uvicorn server on 127.0.0.1 (in a thread, so the
test can slow its model down), real sockets dropped mid-request. Every model forward pass sleeps
``DELAY`` seconds, so a 200-token generation takes far longer than the test waits for anything:
if a dropped client did not cancel its generation, the next request would wait behind it."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from kibidango import write_bundle
from kibidango.speculative import Decoder
from tests.conftest import STORIES, needs_stories

DELAY = 0.1  # seconds per forward pass: 200 tokens take 20 s


class _SlowSession:
    def __init__(self, inner, delay: float):
        self._inner, self._delay = inner, delay

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def feed(self, tokens):
        time.sleep(self._delay)
        return self._inner.feed(tokens)


class SlowModel:
    """A real model whose every forward pass takes ``delay`` seconds longer."""

    def __init__(self, inner, delay: float):
        self.inner, self.delay = inner, delay
        self.name, self.vocab_size, self.context_length = inner.name, inner.vocab_size, inner.context_length

    def new_session(self):
        return _SlowSession(self.inner.new_session(), self.delay)

    def parameters(self) -> int:
        return self.inner.parameters()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, bundle, delay: float, stall_seconds: float = 120.0):
        import uvicorn

        from kibidango.pipeline import Pipeline
        from kibidango.server import create_app

        pipe = Pipeline.from_bundle(bundle, mode="ar")
        pipe.models = {name: SlowModel(m, delay) for name, m in pipe.models.items()}
        pipe.decoder = Decoder(pipe.models)
        self.app = create_app(pipe, model_name="kibidango-tiny", stall_seconds=stall_seconds)
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, log_level="warning", timeout_graceful_shutdown=2
        )
        self.server = uvicorn.Server(config)
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
        self.server.should_exit = True
        self.thread.join(timeout)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    needs_stories()
    root = tmp_path_factory.mktemp("slow")
    return write_bundle(root / "bundle", {"target": {"hf": STORIES, "vocab_size": 512}}, {"mode": "ar"}, preset="tiny")


def _raw_request(port: int, path: str, body: dict) -> socket.socket:
    """Send a request on a raw socket and return the socket unread (the caller drops it)."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return s


def _wait_for(predicate, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def _cancelled(server: Server) -> int:
    return server.scheduler.cancelled


LONG = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0}


def test_a_dropped_stream_cancels_its_generation_and_frees_the_server(bundle):
    srv = Server(bundle, DELAY)
    try:
        s = _raw_request(srv.port, "/v1/completions", {**LONG, "stream": True})
        assert s.recv(4096).startswith(b"HTTP/1.1 200")  # headers (and maybe a first chunk) arrived
        assert _wait_for(lambda: srv.scheduler.active_since is not None, 10), "generation did not start"
        s.close()  # the client goes away mid-stream (curl -m 1)
        assert _wait_for(lambda: _cancelled(srv) == 1), "the abandoned generation was not cancelled"
        r = httpx.post(
            f"{srv.base}/v1/completions", json={"prompt": "Once", "max_tokens": 2, "temperature": 0}, timeout=60
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert "kibidango_requests_cancelled_total" in httpx.get(f"{srv.base}/metrics").text
    finally:
        srv.stop()


def test_a_dropped_plain_request_and_a_dropped_waiter_are_cancelled(bundle):
    srv = Server(bundle, DELAY)
    try:
        first = _raw_request(srv.port, "/v1/completions", LONG)
        assert _wait_for(lambda: srv.scheduler.active_since is not None, 10)
        second = _raw_request(
            srv.port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 200}
        )
        assert _wait_for(lambda: srv.scheduler.waiting == 1, 10), "the second request should wait its turn"
        second.close()
        first.close()
        assert _wait_for(lambda: _cancelled(srv) == 2), "both abandoned requests should be cancelled"
        assert _wait_for(lambda: srv.scheduler.active_since is None and srv.scheduler.waiting == 0, 10)
        r = httpx.post(f"{srv.base}/v1/completions", json={"prompt": "Once", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
    finally:
        srv.stop()


def test_health_reports_a_stalled_generation_and_recovers(bundle):
    srv = Server(bundle, delay=1.5, stall_seconds=0.5)  # every round takes longer than the stall limit
    try:
        assert httpx.get(f"{srv.base}/health").json()["status"] == "ok"
        s = _raw_request(srv.port, "/v1/completions", {**LONG, "max_tokens": 20})
        assert _wait_for(lambda: httpx.get(f"{srv.base}/health").status_code == 503, 20), (
            "health never reported the stall"
        )
        body = httpx.get(f"{srv.base}/health").json()
        assert body["status"] == "wedged" and body["generating"] and body["no_progress_for_s"] > 0.5
        s.close()
        assert _wait_for(lambda: httpx.get(f"{srv.base}/health").status_code == 200, 20)
    finally:
        srv.stop()


def test_shutdown_cancels_an_open_stream_and_completes(bundle):
    srv = Server(bundle, DELAY)
    s = _raw_request(srv.port, "/v1/completions", {**LONG, "stream": True})
    try:
        assert _wait_for(lambda: srv.scheduler.active_since is not None, 10)
        srv.stop(timeout=30)  # what SIGTERM does; the open stream gets 2 s, then it is cancelled
        assert not srv.thread.is_alive(), "the server did not shut down with a stream open"
        assert srv.scheduler.lock.acquire(timeout=10), "the generation kept running after shutdown"
        srv.scheduler.lock.release()
    finally:
        s.close()

"""The server under clients that go away: a real uvicorn server on 127.0.0.1 (in a thread, so the
test can slow its model down), real sockets dropped mid-request. Every model forward pass sleeps
``DELAY`` seconds, so a 200-token generation takes far longer than the test waits for anything:
if a dropped client did not cancel its generation, the next request would wait behind it."""

from __future__ import annotations

import httpx
import pytest

from kibidango import write_bundle
from tests.conftest import STORIES, needs_stories
from tests.slow_server import Server, raw_request, wait_for

DELAY = 0.1  # seconds per forward pass: 200 tokens take 20 s


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    needs_stories()
    root = tmp_path_factory.mktemp("slow")
    return write_bundle(root / "bundle", {"target": {"hf": STORIES, "vocab_size": 512}}, {"mode": "ar"}, preset="tiny")


def _cancelled(server: Server) -> int:
    return server.scheduler.cancelled


LONG = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0}


@pytest.mark.parametrize("parallel", [1, 4])
def test_a_dropped_stream_cancels_its_generation_and_frees_the_server(bundle, parallel):
    srv = Server(bundle, DELAY, parallel=parallel)
    try:
        s = raw_request(srv.port, "/v1/completions", {**LONG, "stream": True})
        assert s.recv(4096).startswith(b"HTTP/1.1 200")  # headers (and maybe a first chunk) arrived
        assert wait_for(lambda: srv.scheduler.active_since is not None, 10), "generation did not start"
        s.close()  # the client goes away mid-stream (curl -m 1)
        assert wait_for(lambda: _cancelled(srv) == 1), "the abandoned generation was not cancelled"
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
        first = raw_request(srv.port, "/v1/completions", LONG)
        assert wait_for(lambda: srv.scheduler.active_since is not None, 10)
        second = raw_request(
            srv.port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 200}
        )
        assert wait_for(lambda: srv.scheduler.waiting == 1, 10), "the second request should wait its turn"
        second.close()
        first.close()
        assert wait_for(lambda: _cancelled(srv) == 2), "both abandoned requests should be cancelled"
        assert wait_for(lambda: srv.scheduler.active_since is None and srv.scheduler.waiting == 0, 10)
        r = httpx.post(f"{srv.base}/v1/completions", json={"prompt": "Once", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
    finally:
        srv.stop()


def test_health_reports_a_stalled_generation_and_recovers(bundle):
    srv = Server(bundle, delay=1.5, stall_seconds=0.5)  # every round takes longer than the stall limit
    try:
        assert httpx.get(f"{srv.base}/health").json()["status"] == "ok"
        s = raw_request(srv.port, "/v1/completions", {**LONG, "max_tokens": 20})
        assert wait_for(lambda: httpx.get(f"{srv.base}/health").status_code == 503, 20), (
            "health never reported the stall"
        )
        body = httpx.get(f"{srv.base}/health").json()
        assert body["status"] == "wedged" and body["generating"] and body["no_progress_for_s"] > 0.5
        s.close()
        assert wait_for(lambda: httpx.get(f"{srv.base}/health").status_code == 200, 20)
    finally:
        srv.stop()


def test_shutdown_cancels_an_open_stream_and_completes(bundle):
    srv = Server(bundle, DELAY)
    s = raw_request(srv.port, "/v1/completions", {**LONG, "stream": True})
    try:
        assert wait_for(lambda: srv.scheduler.active_since is not None, 10)
        srv.stop(timeout=30)  # what SIGTERM does; the open stream gets 2 s, then it is cancelled
        assert not srv.thread.is_alive(), "the server did not shut down with a stream open"
        assert srv.scheduler.lock.acquire(timeout=10), "the generation kept running after shutdown"
        srv.scheduler.lock.release()
    finally:
        s.close()

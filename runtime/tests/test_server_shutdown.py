"""Shutdown answers every request it took: a request still decoding when the grace period ends is
answered 503 with Retry-After (streamed: its text so far, then the error); under load, SIGTERM
to a real ``kibidango serve`` process loses no request — each is answered (200 or 503) or, once
the server is gone, refused before anything was sent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from kibidango.server.loadtest import run_load
from tests.conftest import stories_bundle
from tests.slow_server import Server, free_port, wait_for


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return stories_bundle(tmp_path_factory, "shutdown")


def test_a_request_running_when_the_grace_ends_is_answered_503(bundle):
    srv = Server(bundle, delay=0.05, grace_s=0.5)
    body = {"prompt": "Once upon a time", "max_tokens": 300, "temperature": 0}
    got: dict[str, httpx.Response | list[str]] = {}

    def plain() -> None:
        got["plain"] = httpx.post(f"{srv.base}/v1/completions", json=body, timeout=60)

    def streamed() -> None:
        with httpx.stream("POST", f"{srv.base}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            got["stream"] = list(r.iter_lines())

    threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
    threads[1].start()
    assert wait_for(lambda: srv.scheduler.active_since is not None, 10)
    time.sleep(0.3)  # the stream has sent some text
    threads[0].start()
    assert wait_for(lambda: srv.scheduler.waiting == 1, 10)
    srv.stop(timeout=30)
    for t in threads:
        t.join(30)
    assert not srv.thread.is_alive()
    plain_reply = got["plain"]  # queued when the drain began: refused at once
    assert plain_reply.status_code == 503 and plain_reply.headers["retry-after"].isdigit()
    events = [line.removeprefix("data: ") for line in got["stream"] if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    texts = [json.loads(e)["choices"][0]["text"] for e in events[:-2]]
    cut = json.loads(events[-2])  # the stream that was decoding: its text so far, then the 503 it got
    assert "".join(texts) and cut["error"]["code"] == "shutting_down"


def test_a_non_streamed_request_cut_by_the_grace_gets_503_with_retry_after(bundle):
    srv = Server(bundle, delay=0.05, grace_s=0.5)
    body = {"prompt": "Once upon a time", "max_tokens": 300, "temperature": 0}
    got: dict[str, httpx.Response] = {}
    thread = threading.Thread(
        target=lambda: got.setdefault("r", httpx.post(f"{srv.base}/v1/completions", json=body, timeout=60))
    )
    thread.start()
    assert wait_for(lambda: srv.scheduler.active_since is not None, 10)
    srv.stop(timeout=30)
    thread.join(30)
    r = got["r"]
    assert r.status_code == 503 and r.headers["retry-after"].isdigit() and r.json()["error"]["code"] == "shutting_down"


@pytest.mark.parametrize("parallel", ["1", "8"])
def test_sigterm_under_load_loses_no_request(bundle, tmp_path, parallel):
    """A real server process, 16 clients on fresh connections, SIGTERM mid-run with a short grace:
    every request is answered (200, or 503 once the drain began) or refused at connect time after
    the server is gone. None gets a reset or an empty reply after sending its request."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115 - the server writes it until it ends
    serve = [sys.executable, "-m", "kibidango", "serve", "--bundle", str(bundle), "--port", str(port)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [*serve, "--shutdown-grace", "1", "--threads", "1", "--parallel", parallel],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()[-2000:]
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)

        def progress(n: int) -> None:
            if n == 40:
                proc.send_signal(signal.SIGTERM)

        body = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}
        r = run_load(
            base, body, requests=3000, concurrency=16, timeout_s=60, endpoint="/v1/completions", progress=progress
        )
        assert proc.wait(60) in (0, -signal.SIGTERM)
        assert r.lost == 0, (r.outcomes, (tmp_path / "server.log").read_text()[-3000:])
        assert set(r.outcomes) <= {"200", "503", "refused_connection"}, r.outcomes
        assert r.outcomes["200"] >= 40 and r.outcomes.get("refused_connection", 0) > 0
        assert r.refused_without_retry_after == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()

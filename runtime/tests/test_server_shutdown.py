"""Shutdown answers every request it took: a request still decoding when the grace period ends is
answered 503 with Retry-After (streamed: its text so far, then the error); under load, SIGTERM
to a real ``kibidango serve`` process loses no request — each is answered (200 or 503) or, once
the server is gone, refused before anything was sent."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from kibidango.server.drain import _BPF_JSET_K, _BPF_LD_B_ABS, _BPF_RET_K, _attach_filter, _stop_new_connections
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
        server_log = lambda: (tmp_path / "server.log").read_text()[-3000:]  # noqa: E731
        assert proc.wait(60) in (0, -signal.SIGTERM), (proc.returncode, server_log())
        assert r.lost == 0, (r.outcomes, server_log())
        assert set(r.outcomes) <= {"200", "503", "refused_connection"}, (r.outcomes, server_log())
        assert r.outcomes["200"] >= 40 and r.outcomes.get("refused_connection", 0) > 0, (r.outcomes, server_log())
        assert r.refused_without_retry_after == 0, r.outcomes
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="socket filters are Linux's")
def test_closing_the_listener_refuses_new_clients_and_completes_handshakes_under_way():
    """The race that reset a client after its request was sent: its SYN-ACK left before the drain
    stopped new connections, so its ``connect`` succeeded, but the last ACK of its handshake (and
    its request) came after. Reproduced exactly: a filter that drops every ACK-bearing segment holds
    a client there (connected on its side, never in the server's backlog); then the drain's filter
    replaces it. The client's retransmitted request must complete the handshake and be accepted,
    while a new client's connect never completes and is refused once the socket closes."""
    # the drain's program with the branch reversed: keep segments without ACK (SYNs), drop the rest
    drop_acks = [
        (_BPF_LD_B_ABS, 0, 0, 13),
        (_BPF_JSET_K, 1, 0, 0x10),
        (_BPF_RET_K, 0, 0, 0x40000),
        (_BPF_RET_K, 0, 0, 0),
    ]
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]
    _attach_filter(listener, drop_acks)
    under_way = socket.create_connection(("127.0.0.1", port), timeout=5)  # SYN-ACK received: connected
    under_way.sendall(b"POST / HTTP/1.1\r\n\r\n")  # dropped with the ACK; retransmitted
    listener.settimeout(0.3)
    with pytest.raises(TimeoutError):
        listener.accept()  # held in the handshake, as the race holds it
    _stop_new_connections(listener)
    listener.settimeout(10)
    accepted, _ = listener.accept()  # the retransmission completes the handshake through the new filter
    accepted.settimeout(10)
    assert accepted.recv(64).startswith(b"POST / HTTP/1.1")
    late = socket.socket()
    late.settimeout(0.5)
    with pytest.raises(TimeoutError):
        late.connect(("127.0.0.1", port))  # its SYN is dropped: nothing completes, nothing is sent
    listener.close()
    refused = socket.socket()
    with pytest.raises(ConnectionRefusedError):
        refused.connect(("127.0.0.1", port))
    for s in (under_way, accepted, late, refused):
        s.close()

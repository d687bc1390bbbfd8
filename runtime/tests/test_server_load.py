"""The server under load: a real uvicorn server on 127.0.0.1 whose model is slowed down (every
forward pass sleeps), driven by the load tester's real HTTP clients. A full queue is refused with
429 and Retry-After, never a hang; no request is lost; a request past its timeout gets 504; SIGTERM
refuses the queued requests (503) and lets the running one finish; session memory gives a chat its
earlier exchanges; the cascade's model answers with its tier."""

from __future__ import annotations

import json
import os
import threading

import httpx
import pytest

from kibidango import write_bundle
from kibidango.server.loadtest import percentile, run_load
from tests.conftest import STORIES, needs_stories, stories_bundle
from tests.slow_server import Server, wait_for

CHAT = {"messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return stories_bundle(tmp_path_factory, "load")


def _metric(base: str, name: str, labels: str = "") -> float:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(name + "{") and labels in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in /metrics")


def test_a_full_queue_is_refused_with_retry_after_and_no_request_is_lost(bundle, capsys):
    from kibidango.cli import main

    srv = Server(bundle, delay=0.02, max_queue=2)
    try:
        r = run_load(srv.base, CHAT, requests=24, concurrency=8)
        assert r.lost == 0 and sum(r.outcomes.values()) == 24
        assert set(r.outcomes) == {"200", "429"} and r.outcomes["429"] > 0, r.outcomes  # 8 clients, room for 3
        assert r.refused_without_retry_after == 0
        assert _metric(srv.base, "kibidango_requests_refused_total", 'reason="queue_full"') == r.outcomes["429"]
        assert _metric(srv.base, "kibidango_queue_depth") == 0 and _metric(srv.base, "kibidango_queue_limit") == 2
        # A well-behaved client waits its Retry-After and is answered in the end.
        again = run_load(srv.base, CHAT, requests=24, concurrency=8, retry_refused=True, max_retries=20)
        assert again.outcomes == {"200": 24} and again.retried > 0
        s = again.summary()
        assert s["p50_s"] <= s["p99_s"] and s["answered_per_s"] > 0
        args = ["loadtest", "--url", srv.base, "--requests", "6", "--concurrency", "3", "--max-tokens", "4"]
        assert main([*args, "--retry-refused", "--json"]) == 0
        out = capsys.readouterr().out
        assert "6 requests, 3 concurrent" in out and "(lost: 0;" in out and '"200": 6' in out
    finally:
        srv.stop()


def test_percentile_interpolates_between_ranks():
    assert percentile([3, 1, 2, 4], 50) == 2.5 and percentile([5], 99) == 5
    assert percentile(list(range(101)), 99) == 99


@pytest.mark.parametrize("parallel", [1, 4])
def test_a_request_past_its_timeout_gets_504_and_frees_the_models(bundle, parallel):
    srv = Server(bundle, delay=0.1, request_timeout_s=1.0, parallel=parallel)
    try:
        long = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0}
        outcomes: list[int] = []
        waiter = threading.Thread(
            target=lambda: outcomes.append(httpx.post(f"{srv.base}/v1/completions", json=long, timeout=60).status_code)
        )
        waiter.start()
        assert wait_for(lambda: srv.scheduler.active_since is not None, 10)
        r = httpx.post(f"{srv.base}/v1/completions", json=long, timeout=60)  # waits in the queue, then its time is up
        waiter.join(30)
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
        assert outcomes == [504] and srv.scheduler.timed_out == 2
        assert _metric(srv.base, "kibidango_requests_timed_out_total") == 2
        ok = httpx.post(f"{srv.base}/v1/completions", json={**long, "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200
    finally:
        srv.stop()


def test_sigterm_refuses_the_queued_and_lets_the_running_finish(bundle):
    srv = Server(bundle, delay=0.1, grace_s=20)
    results: dict[str, httpx.Response] = {}

    def send(name: str, max_tokens: int) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0}
        results[name] = httpx.post(f"{srv.base}/v1/completions", json=body, timeout=60)

    threads = [threading.Thread(target=send, args=("running", 20))]
    threads[0].start()
    assert wait_for(lambda: srv.scheduler.active_since is not None, 10)
    threads += [threading.Thread(target=send, args=(f"queued{i}", 20)) for i in range(2)]
    for t in threads[1:]:
        t.start()
    assert wait_for(lambda: srv.scheduler.waiting == 2, 10)
    srv.stop(timeout=30)
    for t in threads:
        t.join(30)
    assert not srv.thread.is_alive()
    assert results["running"].status_code == 200 and results["running"].json()["usage"]["completion_tokens"] == 20
    for name in ("queued0", "queued1"):
        assert results[name].status_code == 503 and results[name].headers["retry-after"].isdigit()
        assert results[name].json()["error"]["code"] == "shutting_down"


def test_session_memory_gives_a_chat_its_earlier_exchanges(bundle, tmp_path):
    from kibidango.cascade.memory import SessionMemory

    memory = SessionMemory(tmp_path, turns=2)
    srv = Server(bundle, delay=0.0, memory=memory)
    try:
        url = f"{srv.base}/v1/chat/completions"
        alone = httpx.post(url, json=CHAT, timeout=60).json()
        first = httpx.post(url, json={**CHAT, "session_id": "s-1"}, timeout=60).json()
        assert first["usage"]["prompt_tokens"] == alone["usage"]["prompt_tokens"]  # nothing remembered yet
        second = httpx.post(url, json=CHAT, headers={"X-Session-Id": "s-1"}, timeout=60).json()
        assert second["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"]  # the first exchange came along
        turns = memory.context("s-1")
        assert [t["role"] for t in turns] == ["user", "assistant"] * 2
        assert turns[1]["content"] == first["choices"][0]["message"]["content"]
        for _ in range(2):
            httpx.post(url, json={**CHAT, "session_id": "s-1"}, timeout=60)
        assert len(memory.context("s-1")) == 4  # bounded: the last 2 exchanges
        assert memory.context("other") == []
        bad = httpx.post(url, json={**CHAT, "session_id": "../etc"}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "session_id"
    finally:
        srv.stop()


def test_the_cascade_model_answers_with_its_tier(bundle, tmp_path):
    from fastapi.testclient import TestClient

    from kibidango.cascade.memory import SessionMemory
    from kibidango.cascade.pipeline import CascadePipeline
    from kibidango.server.app import create_app

    casc = CascadePipeline.from_bundle(bundle, "local-only", state_dir=tmp_path, mode="ar")
    memory = SessionMemory(tmp_path)
    with TestClient(create_app(casc.pipe, model_name="kibidango-tiny", cascade=casc, memory=memory)) as client:
        names = [m["id"] for m in client.get("/v1/models").json()["data"]]
        assert names == ["kibidango-tiny", "kibidango-tiny-cascade"]
        r = client.post("/v1/chat/completions", json={**CHAT, "model": "kibidango-tiny-cascade"}).json()
        cascade = r["kibidango"]["cascade"]
        assert cascade["tier"] == "local" and cascade["usd"] == 0 and cascade["flags"] == ["uncalibrated"]
        plain = client.post("/v1/chat/completions", json=CHAT).json()
        assert "cascade" not in plain["kibidango"]
        assert r["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
        text = client.get("/metrics").text
        assert 'kibidango_cascade_requests_total{model="kibidango-tiny-cascade",tier="local"} 1' in text
        # Streamed: the answer comes whole once its tier is known, the last chunk carries the cascade.
        body = {**CHAT, "model": "kibidango-tiny-cascade", "stream": True, "session_id": "c-1"}
        with client.stream("POST", "/v1/chat/completions", json=body) as stream:
            events = [line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        texts = [c["choices"][0]["delta"].get("content", "") for c in chunks]
        assert texts[0] == r["choices"][0]["message"]["content"] and not any(texts[1:])
        assert chunks[-1]["kibidango"]["cascade"]["tier"] == "local" and chunks[-1]["choices"][0]["finish_reason"]
        assert memory.context("c-1")[1]["content"] == texts[0]


def test_the_models_are_granted_in_arrival_order():
    from kibidango.server.scheduler import FifoLock

    lock = FifoLock()
    first = lock.enter()
    waiting = [lock.enter() for _ in range(4)]
    assert first.is_set() and not any(t.is_set() for t in waiting)
    lock.withdraw(waiting[1])  # a cancelled waiter leaves the queue
    order = []
    for _ in range(3):
        lock.release()
        granted = [i for i, t in enumerate(waiting) if t.is_set() and i not in order]
        order += granted
    assert order == [0, 2, 3]
    lock.withdraw(waiting[3])  # granted, then given up: the lock is free again
    assert lock.acquire(timeout=0.1) and not lock.acquire(timeout=0.05)


def test_a_lock_of_n_permits_grants_n_at_once_in_arrival_order():
    from kibidango.server.scheduler import FifoLock

    lock = FifoLock(3)
    tickets = [lock.enter() for _ in range(5)]
    assert [t.is_set() for t in tickets] == [True, True, True, False, False]
    lock.release()
    assert tickets[3].is_set() and not tickets[4].is_set()


def test_a_batching_server_answers_every_request_and_batches_them(bundle):
    """--parallel 4: concurrent requests decode together (the forwards carry several), every one is
    answered as the serial server answers it (greedy), none lost; the queue and 429 still hold."""
    serial = Server(bundle, delay=0)
    try:
        expected = run_load(serial.base, CHAT, requests=4, concurrency=1, keep_bodies=True)
    finally:
        serial.stop()
    srv = Server(bundle, delay=0, parallel=4)
    try:
        r = run_load(srv.base, CHAT, requests=32, concurrency=8, keep_bodies=True)
        assert r.outcomes == {"200": 32} and r.lost == 0
        texts = {b["choices"][0]["message"]["content"] for b in r.bodies}
        assert texts == {expected.bodies[0]["choices"][0]["message"]["content"]}
        assert _metric(srv.base, "kibidango_parallel") == 4
        forwards = _metric(srv.base, "kibidango_batch_forwards_total")
        assert _metric(srv.base, "kibidango_batch_feeds_total") > forwards > 0
        assert srv.scheduler.batcher.running == 0 and sorted(srv.scheduler.batcher.free) == [0, 1, 2, 3]
    finally:
        srv.stop()


def test_a_chat_template_prompts_with_one_bos(tmp_path):
    """A bundle whose tokenizer carries a chat template (the pipeline's bundles do): the chat's ids
    come from the template itself; encoding its text again would start with two BOS tokens."""
    import shutil

    from fastapi.testclient import TestClient

    from kibidango.pipeline import Pipeline
    from kibidango.server.app import create_app

    needs_stories()
    hf = tmp_path / "hf"
    shutil.copytree(STORIES, hf)
    template = (
        "{{ bos_token }}{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n{% endfor %}### assistant:\n"
    )
    (hf / "chat_template.jinja").write_text(template)
    bundle = write_bundle(tmp_path / "b", {"target": {"hf": hf, "vocab_size": 512}}, {"mode": "ar", "stop_ids": [2]})
    pipe = Pipeline.from_bundle(bundle)
    turns = [{"role": "user", "content": "Once upon a time"}]
    ids = pipe.tokenizer.apply_chat_template(turns, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids[0] == 1 and ids[1] != 1
    with TestClient(create_app(pipe)) as client:
        r = client.post("/v1/chat/completions", json={"messages": turns, "max_tokens": 2}).json()
    assert r["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize(
    ("template", "why"),
    [
        ("{{ ('A' * 99999) * 99999 }}", "larger than this server renders"),
        ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", "range of 99,999"),
        ("{% for i in range(9999) %}{% for j in range(9999) %}{% endfor %}{% endfor %}", "s to render"),
        ("{{ 'x'.ljust(10 ** 10) }}", "larger than this server renders"),
        ("{% for i in range(9000) %}{{ 'y' * 999 }}{% endfor %}", "more than 1,048,576 characters"),
        ("{{ raise_exception('no system role') }}", "refused this conversation: no system role"),
        ("{{ (['x'.center(1000000)] * 600) | join }}", "needed more than 256 MB"),  # 600 MB in one C call
    ],
)
def test_a_hostile_chat_template_is_refused_within_bounds_and_health_answers(tmp_path, template, why):
    """A bundle's chat template is code: one that would allocate gigabytes or loop forever is
    stopped within its time and size bounds and the request refused (400, naming the bound), while
    /health keeps answering (the rendering is off the event loop)."""
    import shutil
    import time as clock

    from fastapi.testclient import TestClient

    from kibidango.pipeline import Pipeline
    from kibidango.server.app import create_app

    needs_stories()
    hf = tmp_path / "hf"
    shutil.copytree(STORIES, hf)
    (hf / "chat_template.jinja").write_text(template)
    bundle = write_bundle(tmp_path / "b", {"target": {"hf": hf, "vocab_size": 512}}, {"mode": "ar", "stop_ids": [2]})
    pipe = Pipeline.from_bundle(bundle)
    health: list[int] = []
    with TestClient(create_app(pipe)) as client:
        done = threading.Event()

        def probe() -> None:
            while not done.is_set():
                health.append(client.get("/health").status_code)
                clock.sleep(0.1)

        prober = threading.Thread(target=probe)
        prober.start()
        started = clock.monotonic()
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        done.set()
        prober.join()
    assert r.status_code == 400 and r.json()["error"]["code"] == "chat_template", r.text
    assert why in r.json()["error"]["message"]
    assert clock.monotonic() - started < 30 and health and set(health) == {200}


def test_a_template_that_allocates_in_one_call_costs_the_server_nothing(tmp_path):
    """``(['x'.center(1000000)] * 600) | join`` passes every bound on items (the call's argument
    and the list's length are small) and allocates 600 MB in one C call no clock interrupts: the
    server's RSS stayed at 1.2 GB after the 400. Templates render in worker processes with an
    address-space cap: the request gets its 400 and the server's memory does not move."""
    import shutil

    from fastapi.testclient import TestClient

    from kibidango.pipeline import Pipeline
    from kibidango.server.app import create_app

    def rss_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    needs_stories()
    hf = tmp_path / "hf"
    shutil.copytree(STORIES, hf)
    (hf / "chat_template.jinja").write_text("{{ (['x'.center(1000000)] * 600) | join }}{{ bos_token }}")
    bundle = write_bundle(tmp_path / "b", {"target": {"hf": hf, "vocab_size": 512}}, {"mode": "ar", "stop_ids": [2]})
    with TestClient(create_app(Pipeline.from_bundle(bundle))) as client:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        client.post("/v1/chat/completions", json=body)  # the worker started, the server warm
        before = rss_mb()
        for _ in range(3):
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 400 and "needed more than 256 MB" in r.json()["error"]["message"], r.text
        assert rss_mb() - before < 50
        assert client.get("/health").status_code == 200

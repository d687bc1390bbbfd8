"""The runtime's local/cloud cascade against a real OpenAI-compatible server on loopback standing in
for the cloud (llama-cpp-python's, serving stories260K for the fault mechanics, and
SmolLM2-135M-Instruct for real answers and corrections) behind a fault-injecting proxy: every
fault ends in a correct cloud or local/degraded answer with its retries counted, the budget is
never overspent, the circuit breaker stops calling a failing cloud, and the key never shows."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eval.shared_data import SHARED
from tests.conftest import OPENAI_KEY_ENV
from tests.fault_proxy import FaultProxy

STORIES = SHARED / "models" / "stories260K" / "hf"


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    if not (STORIES / "model.safetensors").is_file():
        pytest.skip(f"needs stories260K at {STORIES}")
    from kibidango import Pipeline, write_bundle

    root = tmp_path_factory.mktemp("casc")
    bundle = write_bundle(root / "b", {"target": {"hf": STORIES, "vocab_size": 512}}, {"mode": "ar", "stop_ids": [2]})
    return Pipeline.from_bundle(bundle)


def _cascade(pipe, proxy, state, qualifier=1.0 + 1e-6, fallback=1.0 + 1e-6, **cloud):
    from kibidango.cascade.config import parse_cascade
    from kibidango.cascade.pipeline import CascadePipeline

    doc = {
        "qualifier": {"threshold": qualifier},
        "cloud": {
            "base_url": proxy.base_url,
            "model": "stories260K",
            "api_key_env": OPENAI_KEY_ENV,
            "usd_per_1k_prompt": 0.01,
            "usd_per_1k_completion": 0.02,
            "fallback_threshold": fallback,
            "budget_limit": 1.0,
            "timeout_s": 1.0,
            "max_attempts": 4,
            "max_tokens": 16,
            "validation_max_tokens": 8,
            **cloud,
        },
    }
    casc = CascadePipeline(pipe, parse_cascade(doc, "test"), state)
    casc.client._sleep = lambda s: None  # backoff waits are not what these tests measure
    return casc


def _fault_proxy(server: tuple[str, str], monkeypatch, hold_s: float):
    """The fault proxy in front of ``server`` ((base URL, key)), its key in the environment."""
    base, key = server
    monkeypatch.setenv(OPENAI_KEY_ENV, key)
    p = FaultProxy(base.removesuffix("/v1"), hold_s=hold_s)
    yield p
    p.close()


@pytest.fixture
def proxy(openai_server, monkeypatch):
    yield from _fault_proxy(openai_server, monkeypatch, hold_s=2.5)


@pytest.fixture
def instruct_proxy(instruct_server, monkeypatch):
    """The fault proxy in front of a real instruct model (SmolLM2-135M-Instruct)."""
    yield from _fault_proxy(instruct_server, monkeypatch, hold_s=35.0)


def test_a_real_instruct_model_as_the_cloud_answers_and_validates_through_faults(pipe, instruct_proxy, tmp_path):
    """The cloud tier is a real instruct model behind the fault proxy: through a 5xx and a cut
    reply it answers the question itself (greedy: repeatable); in the validation band it reads the
    story model's local answer and corrects it (or approves it, and then the answer is the local one)."""
    question = "What is 2 + 3?"  # a 135M model: it answered the capital of France with a poem
    generous = {"model": "smollm2", "timeout_s": 30.0, "max_tokens": 32, "validation_max_tokens": 48}
    casc = _cascade(pipe, instruct_proxy, tmp_path, **generous)
    instruct_proxy.script("500", "truncate")
    r = casc.answer(question, max_new_tokens=4)
    assert r.tier == "cloud" and "5" in r.text, r.text
    assert r.cloud.retries["server_error"] == 1 and r.cloud.retries["malformed"] == 1 and r.cloud.attempts == 3
    assert r.usd > 0 and casc.ledger.state().settled_usd == pytest.approx(r.usd)

    casc = _cascade(pipe, instruct_proxy, tmp_path / "v", fallback=0.5, **generous)  # confidence 1.0: validate
    r = casc.answer(question, max_new_tokens=8)
    assert r.tier in ("validated", "corrected") and r.text.strip()
    assert (r.text == r.local.text) == (r.tier == "validated")


def test_each_fault_is_retried_to_a_cloud_answer(pipe, proxy, tmp_path):
    casc = _cascade(pipe, proxy, tmp_path)
    spent = 0.0
    for fault, cause in (
        ("timeout", "timeout"),
        ("429", "rate_limited"),
        ("500", "server_error"),
        ("truncate", "malformed"),
    ):
        proxy.script(fault)
        r = casc.answer("Once upon a time", max_new_tokens=4)
        assert r.tier == "cloud" and r.text and r.flags == ["uncalibrated"], (fault, r.flags)  # no calibrator here
        assert r.cloud.retries[cause] == 1 and r.cloud.attempts == 2, fault
        spent += r.usd
        worst = casc.client.paid.endpoint.worst_case_usd([{"role": "user", "content": "Once upon a time"}], 16)
        # a timeout or a cut reply may have been billed: charged its worst case on top of the reply
        assert (r.usd > worst) == (fault in ("timeout", "truncate")), fault
    state = casc.ledger.state()
    assert state.reserved_usd == 0 and state.settled_usd == pytest.approx(spent)
    assert proxy.injected == ["timeout", "429", "500", "truncate"]


def test_exhausted_retries_answer_locally_and_the_breaker_opens(pipe, proxy, tmp_path):
    casc = _cascade(pipe, proxy, tmp_path, max_attempts=2, breaker_failures=2)
    local = pipe.generate("Once upon a time", max_new_tokens=4).text
    for _ in range(2):
        proxy.script("500", "500")
        r = casc.answer("Once upon a time", max_new_tokens=4)
        assert (r.tier, r.flags, r.text) == ("local", ["uncalibrated", "degraded"], local)
        assert r.cloud.retries["server_error"] == 2 and r.usd == 0  # nothing billed: released
    sent = len(proxy.forwarded) + len(proxy.injected)
    r = casc.answer("Once upon a time", max_new_tokens=4)
    assert r.flags[-1] == "degraded" and r.cloud.error == "circuit breaker open"
    assert len(proxy.forwarded) + len(proxy.injected) == sent  # the open breaker called nobody
    assert casc.ledger.state().settled_usd == 0 and casc.ledger.state().reserved_usd == 0


def test_budget_spent_answers_locally_and_never_overspends(pipe, proxy, tmp_path):
    from kibidango.paid.client import Endpoint

    worst = Endpoint("x", "m", None, 0.01, 0.02).worst_case_usd([{"role": "user", "content": "Once upon a time"}], 16)
    limit = 1.3 * worst  # the first call fits; the spend and one more worst case soon do not
    casc = _cascade(pipe, proxy, tmp_path, budget_limit=limit)
    tiers = [casc.answer("Once upon a time", max_new_tokens=4) for _ in range(4)]
    assert tiers[0].tier == "cloud" and tiers[-1].flags[-1] == "budget_exhausted" and tiers[-1].tier == "local"
    state = casc.ledger.state()
    assert state.settled_usd <= limit + 1e-12 and state.settled_usd == pytest.approx(sum(t.usd for t in tiers))
    assert tiers[-1].budget_left_usd == pytest.approx(state.left_usd)


HOSTILE_USAGE = (
    '{"prompt_tokens": -100000000, "completion_tokens": -100000000, "total_tokens": -200000000}',
    '{"prompt_tokens": NaN, "completion_tokens": NaN, "total_tokens": NaN}',
    '{"prompt_tokens": "twelve", "completion_tokens": [3], "total_tokens": null}',
    '{"prompt_tokens": 1.5, "completion_tokens": 2, "total_tokens": 3.5}',
    '{"completion_tokens": 3}',
    "absent",
)


def test_a_reply_never_credits_the_budget(pipe, proxy, tmp_path):
    """Hostile usage from the provider (negative, NaN, strings, fractions, a missing count, none
    at all) is charged at the call's reservation, counted as untrusted, never credited: the number
    of paid calls a budget allows stays what the worst case allows. (Credible usage dearer than the
    reservation is recorded as reported: the next test.)"""
    import sqlite3

    casc = _cascade(pipe, proxy, tmp_path, max_attempts=1)

    def rows():
        return (
            sqlite3.connect(tmp_path / "ledger.sqlite")
            .execute(
                "SELECT reserved_usd, settled_usd, untrusted FROM entries WHERE state = 'settled' ORDER BY created"
            )
            .fetchall()
        )

    for usage in HOSTILE_USAGE:
        proxy.script(f"usage={usage}")
        r = casc.answer("Once upon a time", max_new_tokens=4)
        assert r.tier == "cloud", (usage, r.flags)
        reserved, settled, untrusted = rows()[-1]
        assert settled == pytest.approx(reserved) and untrusted == 1 and r.usd == pytest.approx(reserved), usage
    assert casc.client.counts["usage_untrusted"] == len(HOSTILE_USAGE)
    assert casc.ledger.untrusted == len(HOSTILE_USAGE)
    proxy.script("ok")  # the server's own usage is believed: less than the worst case
    casc.answer("Once upon a time", max_new_tokens=4)
    reserved, settled, untrusted = rows()[-1]
    assert 0 < settled < reserved and untrusted == 0

    # a budget for exactly three worst cases: negative usage on every reply buys no fourth call
    budget = 3 * reserved + reserved / 2
    casc = _cascade(pipe, proxy, tmp_path / "b", max_attempts=1, budget_limit=budget)
    proxy.script(*[f"usage={HOSTILE_USAGE[0]}"] * 10)
    before = len(proxy.forwarded)
    tiers = [casc.answer("Once upon a time", max_new_tokens=4).tier for _ in range(6)]
    assert len(proxy.forwarded) - before == 3 and tiers.count("cloud") == 3
    assert casc.ledger.state().settled_usd <= budget


def test_a_reply_dearer_than_its_reservation_is_recorded_as_reported_and_stops_spending(pipe, proxy, tmp_path):
    """The worst case a call reserved was not the worst case (a provider billing what it billed): the
    reply's credible cost is recorded as reported, never truncated to the reservation, and every
    process on that ledger stops spending until someone checks the bill and reconciles
    (``kibidango budget --reconcile``)."""
    from kibidango.cli import main
    from kibidango.paid.ledger import Ledger, holds

    casc = _cascade(pipe, proxy, tmp_path, max_attempts=1, budget_limit=100.0)
    proxy.script('usage={"prompt_tokens": 1000000, "completion_tokens": 0, "total_tokens": 1000000}')
    r = casc.answer("Once upon a time", max_new_tokens=4)
    assert r.tier == "cloud" and r.cloud.over_reservation and not r.cloud.usage_untrusted
    assert r.usd == pytest.approx(1_000_000 * 0.01 / 1000) and r.usd > r.cloud.reserved  # $10 recorded, not truncated
    assert casc.ledger.state().settled_usd == pytest.approx(10.0)
    sent = len(proxy.forwarded)
    again = casc.answer("Once upon a time", max_new_tokens=4)  # $90 left, but on hold
    assert again.tier == "local" and again.flags[-1] == "budget_exhausted" and len(proxy.forwarded) == sent
    other = Ledger(tmp_path, 100.0, "month")  # another process on the same state directory
    with pytest.raises(Exception, match="on hold"):
        other.reserve(0.01)
    assert len(holds(tmp_path)) == 1
    assert main(["budget", "--state-dir", str(tmp_path), "--reconcile", "--note", "bill checked"]) == 0
    assert holds(tmp_path) == [] and casc.ledger.state().settled_usd == pytest.approx(10.0)  # the record stands
    assert casc.answer("Once upon a time", max_new_tokens=4).tier == "cloud"


def test_a_429_with_an_unreadable_retry_after_is_retried_and_not_charged(pipe, proxy, tmp_path):
    """Retry-After "soon" is neither seconds nor an HTTP date: the client backs off as for any 429
    and sends again; the 429 is not charged."""
    casc = _cascade(pipe, proxy, tmp_path)
    proxy.script("429-soon")
    r = casc.answer("Once upon a time", max_new_tokens=4)
    assert r.tier == "cloud" and r.cloud.retries["rate_limited"] == 1 and r.cloud.attempts == 2, r.cloud
    assert r.usd < r.cloud.reserved  # only the answered attempt, at its usage


def test_a_reply_larger_than_the_cap_is_refused_as_it_streams_in(pipe, proxy, tmp_path):
    """A 64 MB reply body (with its length declared, or without one) is refused, not read whole: a
    malformed attempt (maybe billed: charged its worst case), then the next attempt answers."""
    import resource

    casc = _cascade(pipe, proxy, tmp_path)
    for fault in ("huge", "huge-unsized"):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        proxy.script(fault)
        r = casc.answer("Once upon a time", max_new_tokens=4)
        assert r.tier == "cloud" and r.cloud.retries["malformed"] == 1 and r.cloud.attempts == 2, (fault, r.cloud)
        grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        assert grown_mb < 32, (fault, grown_mb)  # never held the 64 MB


def test_the_reservation_bounds_what_an_honest_server_bills(instruct_server, monkeypatch, tmp_path):
    """The reservation was the messages' content bytes plus 64 tokens, whatever the number of
    messages: 60 messages (59 empty) reserved $0.098 and the server billed $0.498. It now bounds
    each message as JSON plus the template's tokens around it: a real ChatML template's count (the
    server's own usage) stays within it, and the ledger records that count, below the reservation."""
    from kibidango.paid.client import Endpoint, PaidClient
    from kibidango.paid.ledger import Ledger

    base, key = instruct_server
    monkeypatch.setenv(OPENAI_KEY_ENV, key)
    endpoint = Endpoint(base, "smollm2", OPENAI_KEY_ENV, usd_per_1k_prompt=1.0, usd_per_1k_completion=1.0)
    client = PaidClient(endpoint, Ledger(tmp_path, 100.0, "total"))
    for messages in (
        [{"role": "user", "content": ""}] * 59 + [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": ""}, {"role": "user", "content": "é" * 50}],
        [{"role": "user", "content": "Add up: " + " ".join("1234567890" * 3 for _ in range(10))}],  # a token per digit
    ):
        r = client.chat(messages, max_tokens=16)
        assert r.status == "ok" and r.prompt_tokens <= endpoint.worst_case_tokens(messages), r
        assert not r.over_reservation and r.usd == pytest.approx((r.prompt_tokens + r.completion_tokens) / 1000)
    assert client.ledger.over == 0 and client.ledger.untrusted == 0


def test_validation_band_and_the_local_band(pipe, proxy, tmp_path):
    import hashlib
    import json

    from kibidango.cascade.pipeline import VALIDATION_PROMPT

    casc = _cascade(pipe, proxy, tmp_path, fallback=0.5)  # uncalibrated confidence 1.0: between the two
    r = casc.answer("Once upon a time", max_new_tokens=4)
    assert r.tier in ("validated", "corrected")  # the story model never says APPROVE: corrected
    asked = [{"role": "user", "content": VALIDATION_PROMPT.format(question="Once upon a time", answer=r.local.text)}]
    assert proxy.prompts()[-1] == hashlib.sha256(json.dumps(asked, sort_keys=True).encode()).hexdigest()
    casc = _cascade(pipe, proxy, tmp_path, qualifier=0.9, fallback=0.5)
    before = len(proxy.forwarded)
    r = casc.answer("Once upon a time", max_new_tokens=4)
    assert (r.tier, r.usd, r.flags) == ("local", 0.0, ["uncalibrated"]) and len(proxy.forwarded) == before


def test_a_missing_key_answers_locally_and_no_key_ever_shows(pipe, proxy, tmp_path, monkeypatch):
    import os

    key = os.environ[OPENAI_KEY_ENV]
    casc = _cascade(pipe, proxy, tmp_path)
    proxy.script("500")
    shown = repr(casc.answer("Once upon a time", max_new_tokens=4).to_dict())
    monkeypatch.delenv(OPENAI_KEY_ENV)
    r = casc.answer("Once upon a time", max_new_tokens=4)
    assert r.tier == "local" and r.flags[-1] == "no_key" and OPENAI_KEY_ENV in r.cloud.error
    assert key not in shown + repr(r.to_dict()) + r.cloud.error


def test_a_cloud_that_refuses_connections_is_retried_then_answered_locally(pipe, proxy, tmp_path):
    from methods.local_server import free_port

    casc = _cascade(pipe, proxy, tmp_path, max_attempts=3)
    nobody = f"http://127.0.0.1:{free_port()}/v1"
    casc.client.paid.endpoint = dataclasses.replace(casc.client.paid.endpoint, base_url=nobody)
    r = casc.answer("Once upon a time", max_new_tokens=4)
    assert (r.tier, r.flags[-1], r.usd) == ("local", "degraded", 0.0)
    assert r.cloud.retries["connection"] == 3 and r.cloud.attempts == 3  # nothing was sent: nothing charged
    assert casc.ledger.state().settled_usd == 0 and casc.ledger.state().reserved_usd == 0


def test_a_prompt_past_the_local_context_goes_to_the_cloud(pipe, proxy, tmp_path):
    from kibidango.backends.base import ContextLengthError
    from kibidango.cascade.config import load_cascade
    from kibidango.cascade.pipeline import CascadePipeline

    long = "Once upon a time " * 200  # past stories260K's 512 tokens
    casc = _cascade(pipe, proxy, tmp_path, qualifier=0.5, fallback=0.1)  # would accept any local answer
    r = casc.answer(long, query="Once upon a time", max_new_tokens=4)
    assert (r.tier, r.flags, r.local) == ("cloud", ["local_context"], None) and r.text and r.usd > 0
    with pytest.raises(ContextLengthError):  # without a cloud there is no one else to ask
        CascadePipeline(pipe, load_cascade("local-only"), tmp_path).answer(long, max_new_tokens=4)


def test_the_server_sends_a_prompt_past_the_local_context_to_the_cloud(pipe, proxy, tmp_path, monkeypatch):
    """Through the server: the cascade's model takes a prompt longer than the local context (its
    cloud answers it); the plain model refuses it with a 400 naming its limit. (The local context
    is cut to 64 tokens here: the cloud stand-in is the same 512-token model.)"""
    from fastapi.testclient import TestClient

    from kibidango.server.app import create_app

    monkeypatch.setattr(pipe.models["target"], "context_length", 64)
    casc = _cascade(pipe, proxy, tmp_path, qualifier=0.5, fallback=0.1)
    long = [{"role": "user", "content": "Once upon a time " * 30}]
    with TestClient(create_app(pipe, model_name="kb", cascade=casc)) as client:
        r = client.post("/v1/chat/completions", json={"model": "kb-cascade", "messages": long, "max_tokens": 4})
        assert r.status_code == 200, r.text
        cascade = r.json()["kibidango"]["cascade"]
        assert cascade["tier"] == "cloud" and "local_context" in cascade["flags"], cascade
        assert r.json()["choices"][0]["message"]["content"]
        r = client.post("/v1/chat/completions", json={"model": "kb", "messages": long, "max_tokens": 4})
        assert r.status_code == 400 and "this server accepts at most 63" in r.json()["error"]["message"]


def _serve(bundle, port: int, config, state, env, log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kibidango",
                "serve",
                "--bundle",
                str(bundle),
                "--port",
                str(port),
                "--cascade",
                str(config),
                "--state-dir",
                str(state),
                "--shutdown-grace",
                "30",
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _ready(base: str, proc: subprocess.Popen, seconds: float = 120) -> None:
    import httpx

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the server exited"
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{base} did not start")


def _metrics(base: str) -> dict[str, float]:
    import httpx

    out = {}
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_two_servers_share_one_budget_under_load_and_a_restart(pipe, proxy, tmp_path):
    """200 chat requests, 16 concurrent, over 2 server processes sharing one ledger; one server is
    restarted (SIGTERM, drained, started again) mid-run, its clients waiting for it. The spend
    stays within the limit, the ledger equals the sum of the costs the responses report, no
    request is lost."""
    import json
    import os
    import threading

    import httpx

    from kibidango.paid.ledger import Ledger
    from kibidango.server.loadtest import run_load
    from methods.local_server import free_port

    limit = 0.1  # about 160 of the 200 answers: the budget runs out near the end
    config = tmp_path / "cascade.json"
    config.write_text(
        json.dumps(
            {
                "qualifier": {"threshold": 1.0 + 1e-6},  # every answer goes to the cloud until the budget is spent
                "cloud": {
                    "base_url": proxy.base_url,
                    "model": "stories260K",
                    "api_key_env": OPENAI_KEY_ENV,
                    "usd_per_1k_prompt": 0.01,
                    "usd_per_1k_completion": 0.02,
                    "fallback_threshold": 1.0 + 1e-6,
                    "budget_limit": limit,
                    "budget_period": "total",
                    "timeout_s": 20,
                    "max_attempts": 4,
                    "max_tokens": 16,
                },
            }
        )
    )
    state = tmp_path / "state"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    key = os.environ[OPENAI_KEY_ENV]
    ports = [free_port(), free_port()]
    bases = [f"http://127.0.0.1:{p}" for p in ports]
    log = tmp_path / "servers.log"
    procs = [_serve(pipe.bundle.root, p, config, state, env, log) for p in ports]
    restarted = threading.Event()
    at_restart: list[float] = []
    try:
        for base, proc in zip(bases, procs, strict=True):
            _ready(base, proc)
        proxy.script("500", "ok", "429", "ok", "500")  # a few faults on the way: retried

        def restart_second(n: int) -> None:
            if n != 20:
                return
            procs[1].send_signal(signal.SIGTERM)  # drains: running requests finish, queued ones get 503
            assert procs[1].wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once drained
            at_restart.append(Ledger(state, limit, "total").state().settled_usd)
            procs[1] = _serve(pipe.bundle.root, ports[1], config, state, env, log)
            _ready(bases[1], procs[1])
            restarted.set()

        (model,) = [m["id"] for m in httpx.get(f"{bases[0]}/v1/models").json()["data"] if m["id"].endswith("-cascade")]
        bodies = [
            {"model": model, "messages": [{"role": "user", "content": f"Once upon a time {i}"}], "max_tokens": 4}
            for i in range(200)
        ]
        r = run_load(
            bases,
            bodies,
            requests=200,
            concurrency=16,
            timeout_s=120,
            retry_refused=True,
            max_retries=200,
            keep_bodies=True,
            progress=restart_second,
            failover=False,
        )
        assert r.outcomes == {"200": 200} and r.lost == 0, r.outcomes
        assert restarted.is_set() and 0 < at_restart[0] < limit
        cascades = [b["kibidango"]["cascade"] for b in r.bodies]
        ledger = Ledger(state, limit, "total").state()
        assert ledger.reserved_usd == 0
        assert ledger.settled_usd <= limit  # to the cent, and below
        assert ledger.settled_usd == pytest.approx(sum(c["usd"] for c in cascades), abs=1e-9)
        tiers = {t: sum(c["tier"] == t for c in cascades) for t in ("cloud", "local")}
        assert tiers["cloud"] > 100 and tiers["local"] > 0, tiers  # the budget ran out: local answers after
        exhausted = [c for c in cascades if c["tier"] == "local"]
        assert all(c["flags"][-1] == "budget_exhausted" for c in exhausted)
        assert min(c["budget_left_usd"] for c in cascades) < 0.002  # what is left fits no worst case
        assert sum(c["cloud_retries"].get("server_error", 0) for c in cascades) == 2
        for base in bases:
            m = _metrics(base)
            name = f'model="{model}"'
            assert m[f'kibidango_cloud_budget_spent_usd{{{name},period="total"}}'] == pytest.approx(ledger.settled_usd)
            assert m[f'kibidango_cloud_budget_left_usd{{{name},period="total"}}'] == pytest.approx(ledger.left_usd)
            assert m[f"kibidango_cloud_request_seconds_count{{{name}}}"] > 0  # the restarted one spent too
            buckets = [v for k, v in m.items() if k.startswith(f"kibidango_cloud_request_seconds_bucket{{{name},")]
            assert buckets == sorted(buckets)  # cumulative, and the +Inf bucket is the count, not a sum of sums
            assert buckets[-1] == m[f"kibidango_cloud_request_seconds_count{{{name}}}"]
            assert m[f'kibidango_queue_depth{{model="{model.removesuffix("-cascade")}"}}'] == 0
            assert key not in httpx.get(f"{base}/metrics").text
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)
    assert key not in log.read_text(errors="replace") + json.dumps(r.bodies)  # the servers' logs, the responses

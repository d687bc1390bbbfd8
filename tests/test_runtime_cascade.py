"""The runtime's local/cloud cascade against a real OpenAI-compatible server on loopback standing in
for the cloud (llama-cpp-python's, serving stories260K) behind a fault-injecting proxy: every
fault ends in a correct cloud or local/degraded answer with its retries counted, the budget is
never overspent, the circuit breaker stops calling a failing cloud, and the key never shows."""

from __future__ import annotations

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
    from kibidango.cascade import parse_cascade
    from kibidango.cascade_pipeline import CascadePipeline

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
            "max_retries": 3,
            "max_tokens": 16,
            "validation_max_tokens": 8,
            **cloud,
        },
    }
    casc = CascadePipeline(pipe, parse_cascade(doc, "test"), state)
    casc.client._sleep = lambda s: None  # backoff waits are not what these tests measure
    return casc


@pytest.fixture
def proxy(openai_server, monkeypatch):
    base, key = openai_server
    monkeypatch.setenv(OPENAI_KEY_ENV, key)
    p = FaultProxy(base.removesuffix("/v1"), hold_s=2.5)
    yield p
    p.close()


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
        worst = casc.client.worst_case_usd("Once upon a time", 16)
        # a timeout or a cut reply may have been billed: charged its worst case on top of the reply
        assert (r.usd > worst) == (fault in ("timeout", "truncate")), fault
    state = casc.ledger.state()
    assert state.reserved_usd == 0 and state.settled_usd == pytest.approx(spent)
    assert proxy.injected == ["timeout", "429", "500", "truncate"]


def test_exhausted_retries_answer_locally_and_the_breaker_opens(pipe, proxy, tmp_path):
    casc = _cascade(pipe, proxy, tmp_path, max_retries=1, breaker_failures=2)
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
    casc = _cascade(pipe, proxy, tmp_path, budget_limit=0.0015)
    tiers = [casc.answer("Once upon a time", max_new_tokens=4) for _ in range(4)]
    assert tiers[0].tier == "cloud" and tiers[-1].flags[-1] == "budget_exhausted" and tiers[-1].tier == "local"
    state = casc.ledger.state()
    assert state.settled_usd <= 0.0015 + 1e-12 and state.settled_usd == pytest.approx(sum(t.usd for t in tiers))
    assert tiers[-1].budget_left_usd == pytest.approx(state.left_usd)


def test_validation_band_and_the_local_band(pipe, proxy, tmp_path):
    import hashlib
    import json

    from kibidango.cascade_pipeline import VALIDATION_PROMPT

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

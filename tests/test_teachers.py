"""Teacher tiers against a real OpenAI-compatible server on loopback, behind a fault-injecting
proxy: retries by cause, Retry-After, dead endpoints by name, and a budget never overspent."""

from __future__ import annotations

import json
import threading

import pytest

from kibidango.paid.ledger import Ledger
from methods.teachers import TeacherClient, TierConfig, TierDead, worst_case_usd
from tests.conftest import OPENAI_KEY_ENV
from tests.fault_proxy import FaultProxy


@pytest.fixture
def proxy(openai_server):
    base, _ = openai_server
    p = FaultProxy(base.removesuffix("/v1"), hold_s=2.5)
    yield p
    p.close()


def _ledger(tmp_path, limit: float = 100.0) -> Ledger:
    return Ledger(tmp_path / "budget", limit, "total")


def _tier(base_url: str, **kw) -> TierConfig:
    settings = {
        "name": "open",
        "base_url": base_url,
        "model": "stories260K",
        "api_key_env": OPENAI_KEY_ENV,
        "max_tokens": 24,
        "timeout_s": 1.5,
        "backoff_s": 0.01,
        "usd_per_1k_prompt": 0.5,
        "usd_per_1k_completion": 1.5,
        **kw,
    }
    return TierConfig(**settings)


def test_every_fault_is_retried_and_counted(openai_server, proxy, monkeypatch, tmp_path):
    _, key = openai_server
    monkeypatch.setenv(OPENAI_KEY_ENV, key)
    slept: list[float] = []
    ledger = _ledger(tmp_path)
    client = TeacherClient(_tier(proxy.base_url, max_attempts=6), ledger, sleep=slept.append)
    proxy.script("429", "500", "truncate", "timeout")
    reply = client.ask("Once upon a time")
    assert reply.text and reply.attempts == 5
    assert dict(reply.retries) == {"rate_limited": 1, "server_error": 1, "malformed": 1, "timeout": 1}
    assert slept[0] == 1.0  # the 429's Retry-After, honoured
    assert reply.maybe_paid  # the timed-out request was served upstream
    assert reply.prompt_tokens > 0 and reply.completion_tokens > 0
    # charged: the two unread attempts (cut, timed out) at their worst case, the answer at its usage
    answer = (reply.prompt_tokens * 0.5 + reply.completion_tokens * 1.5) / 1000
    assert reply.unread == 2 and reply.usd == pytest.approx(2 * reply.reserved + answer)
    assert ledger.state().settled_usd == pytest.approx(reply.usd) and ledger.state().reserved_usd == 0
    # upstream saw the truncated, the timed-out and the final request; the 429 and 500 never left the proxy
    assert len(proxy.prompts()) == 3


def test_a_call_that_exhausts_its_attempts_says_why(openai_server, proxy, monkeypatch, tmp_path):
    _, key = openai_server
    monkeypatch.setenv(OPENAI_KEY_ENV, key)
    client = TeacherClient(_tier(proxy.base_url, max_attempts=2), _ledger(tmp_path), sleep=lambda s: None)
    proxy.script("500", "500")
    reply = client.ask("Once upon a time")
    assert reply.text is None and reply.attempts == 2 and "HTTP 500" in reply.error
    assert reply.usd == 0 and client.paid.ledger.state().settled_usd == 0  # a 500 bills nothing: released


def test_dead_tiers_are_reported_by_name(openai_server, monkeypatch, tmp_path):
    base, key = openai_server
    monkeypatch.setenv(OPENAI_KEY_ENV, "sk-" + "y" * 40)
    with pytest.raises(TierDead, match="teacher tier open .*HTTP 401") as err:
        TeacherClient(_tier(base), _ledger(tmp_path)).ask("hello")
    assert "y" * 40 not in str(err.value)
    monkeypatch.setenv(OPENAI_KEY_ENV, key)
    with pytest.raises(TierDead, match="teacher tier open .*unreachable"):
        TeacherClient(_tier("http://127.0.0.1:9/v1", max_attempts=2), _ledger(tmp_path), sleep=lambda s: None).ask(
            "hello"
        )


def test_the_budget_holds_the_worst_case_and_never_overspends(tmp_path):
    from kibidango.paid.ledger import BudgetExceeded

    tier = TierConfig(name="t", base_url="http://x/v1", model="m", usd_per_1k_prompt=1.0, usd_per_1k_completion=2.0)
    worst = worst_case_usd(tier, "abc")
    messages = [{"role": "system", "content": tier.system}, {"role": "user", "content": "abc"}]
    prompt = sum(len(json.dumps(m).encode()) + 16 for m in messages) + 64  # each message as JSON, the template's
    assert worst == pytest.approx((prompt * 1.0 + 256 * 2.0) / 1000)
    budget = _ledger(tmp_path, limit=worst * 10.5)
    granted = []

    def take():
        while True:
            try:
                rid = budget.reserve(worst)
            except BudgetExceeded:
                return
            granted.append(worst)
            budget.settle(rid, worst * 0.5)  # the endpoint reports less than the worst case

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    state = budget.state()
    assert state.settled_usd <= budget.limit_usd and state.reserved_usd == pytest.approx(0)
    assert budget.limit_usd - state.settled_usd < worst  # it stopped only when the worst case no longer fit
    reference = TierConfig(name="gold", kind="reference", usd_per_answer=0.25)
    assert worst_case_usd(reference, "anything") == 0.25 and reference.paid


def test_usage_a_reply_reports_is_believed_only_when_credible():
    """1D's teachers: absent, negative, fractional or non-numeric counts are not believed (the
    stage then charges the request's worst case, as kibidango.paid.ledger.trusted_cost does)."""
    from types import SimpleNamespace

    from kibidango.paid.client import credible_usage
    from kibidango.paid.ledger import trusted_cost

    assert credible_usage(SimpleNamespace(prompt_tokens=12, completion_tokens=3)) == (12, 3)
    for usage in (
        None,
        SimpleNamespace(prompt_tokens=-5, completion_tokens=3),
        SimpleNamespace(prompt_tokens=1.5, completion_tokens=3),
        SimpleNamespace(prompt_tokens="12", completion_tokens=3),
        SimpleNamespace(prompt_tokens=float("nan"), completion_tokens=3),
        SimpleNamespace(completion_tokens=3),
    ):
        assert credible_usage(usage) == (None, None), usage
    assert trusted_cost(None, 0.5) == (0.5, False) and trusted_cost(-2000.0, 0.5) == (0.5, False)
    assert trusted_cost(0.2, 0.5) == (0.2, True)
    assert trusted_cost(7.0, 0.5) == (7.0, True)  # dearer than reserved: recorded as reported (the ledger holds)


def test_one_endpoint_type_for_tiers_judges_and_the_cloud():
    """1D's tiers, the llm judge and the cascade's cloud embed one endpoint type: the same fields,
    checked the same way (a key where its variable's name belongs is refused without being echoed),
    one retry vocabulary (``max_attempts``, retries included), and one way to the paid client's
    Endpoint."""
    from pydantic import ValidationError

    from kibidango.cascade.config import CloudConfig
    from kibidango.paid.settings import EndpointSettings, config_error
    from methods.judges.llm import LLMJudgeSettings
    from methods.teachers import TierConfig, _endpoint

    endpoint_fields = set(EndpointSettings.model_fields)
    for kind in (TierConfig, LLMJudgeSettings, CloudConfig):
        assert issubclass(kind, EndpointSettings) and endpoint_fields <= set(kind.model_fields), kind
        assert "max_retries" not in kind.model_fields, kind
    key = "sk-" + "z" * 40
    for kind, extra in ((TierConfig, {"name": "t"}), (LLMJudgeSettings, {}), (EndpointSettings, {})):
        with pytest.raises(ValidationError) as e:
            kind(base_url="http://127.0.0.1:9/v1", model="m", api_key_env=key, **extra)
        message = config_error(e.value, "recipe.yaml")
        assert "recipe.yaml: api_key_env: the NAME of an environment variable" in message and key not in message
    with pytest.raises(ValidationError, match="an http"):
        EndpointSettings(base_url="ftp://x", model="m")
    tier = TierConfig(name="t", serve="package:x/y.gguf", max_attempts=2, timeout_s=5)
    e = _endpoint(tier, "http://127.0.0.1:7/v1")  # a served tier: its address known once served
    assert (e.base_url, e.model, e.max_attempts, e.timeout_s, e.name) == (
        "http://127.0.0.1:7/v1",
        "t",
        2,
        5,
        "teacher t",
    )
    judge = LLMJudgeSettings(base_url="http://127.0.0.1:9/v1", model="m").endpoint("llm judge m")
    assert (judge.max_attempts, judge.timeout_s) == (3, 60.0)

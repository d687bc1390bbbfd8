"""eval-cascade's oracle cloud: an OpenAI-compatible server on loopback answering with the gold
solution, called through the runtime's real paid client (HTTP, key, ledger)."""

from __future__ import annotations

import pytest


def test_the_gold_stand_in_answers_with_the_gold_solution_through_the_paid_client(tmp_path, monkeypatch):
    from eval.gold_server import GOLD_MODEL, gold_server
    from kibidango.cascade.pipeline import VALIDATION_PROMPT
    from kibidango.paid.client import Endpoint, PaidClient
    from kibidango.paid.ledger import Ledger

    gold = {"What is 2 + 5?": "2 + 5 = 7\n#### 7", "Write add(a, b).": "def add(a, b):\n    return a + b\n"}
    monkeypatch.setenv("KB_GOLD_KEY", "kbd-gold-test")
    with gold_server(gold, "kbd-gold-test") as base:
        endpoint = Endpoint(base, GOLD_MODEL, "KB_GOLD_KEY", usd_per_1k_prompt=1.0, usd_per_1k_completion=1.0)
        client = PaidClient(endpoint, Ledger(tmp_path, 10.0, "total"))
        r = client.chat([{"role": "user", "content": "What is 2 + 5?"}], max_tokens=64)
        assert r.status == "ok" and r.text == gold["What is 2 + 5?"] and not r.over_reservation
        check = VALIDATION_PROMPT.format(question="Write add(a, b).", answer="def add(a, b): return a - b")
        v = client.chat([{"role": "user", "content": check}], max_tokens=64)
        assert v.text == gold["Write add(a, b)."]  # the oracle corrects; it never approves
        cut = client.chat([{"role": "user", "content": "Write add(a, b)."}], max_tokens=2)
        assert cut.finish_reason == "length" and len(cut.text.encode()) <= 8 and not cut.over_reservation
        monkeypatch.setenv("KB_GOLD_KEY", "wrong")
        assert client.chat([{"role": "user", "content": "What is 2 + 5?"}], max_tokens=8).status == "refused"
    assert client.ledger.over == 0 and client.ledger.state().settled_usd > 0


@pytest.mark.parametrize("content", ["unknown question", ""])
def test_an_unknown_question_gets_no_answer(content):
    from eval.gold_server import _answer

    assert _answer({"q": "a"}, content) == ""

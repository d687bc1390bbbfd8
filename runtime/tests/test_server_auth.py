"""API keys on the OpenAI-compatible server, through the ``openai`` client: the right key is
served, a wrong key or none gets 401 in OpenAI's error shape (the key never echoed); session
memory belongs to the key that made it (another key with the same session id sees nothing) and
can be forgotten; without keys the server binds loopback only unless told otherwise."""

from __future__ import annotations

import httpx
import openai
import pytest

from kibidango.cascade.memory import SessionMemory
from kibidango.server.auth import key_scope, load_api_keys
from kibidango.server.launch import serve
from tests.conftest import stories_bundle
from tests.slow_server import Server

ALICE = "sk-alice-0123456789abcdef0123456789"
BOB = "sk-bob-fedcba9876543210fedcba98765"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return stories_bundle(tmp_path_factory, "auth")


@pytest.fixture(scope="module")
def server(bundle, tmp_path_factory):
    memory = SessionMemory(tmp_path_factory.mktemp("state"))
    srv = Server(bundle, delay=0.0, memory=memory, api_keys=[ALICE, BOB])
    srv.memory = memory
    yield srv
    srv.stop()


def _client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key=key, max_retries=0, timeout=30)


def test_the_right_key_is_served_and_a_wrong_key_or_none_gets_401(server):
    reply = _client(server, ALICE).completions.create(model="kibidango-tiny", prompt="Once upon a time", max_tokens=4)
    assert reply.choices[0].text and reply.usage.completion_tokens == 4
    wrong = "sk-wrong-" + "z" * 30
    with pytest.raises(openai.AuthenticationError) as e:
        _client(server, wrong).completions.create(model="kibidango-tiny", prompt="Once upon a time", max_tokens=4)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    assert wrong not in e.value.response.text and "Incorrect API key" in e.value.message
    bare = httpx.post(f"{server.base}/v1/completions", json={"prompt": "Once", "max_tokens": 2})
    assert bare.status_code == 401 and "didn't provide an API key" in bare.json()["error"]["message"]
    assert bare.headers["www-authenticate"] == "Bearer"
    basic = httpx.get(f"{server.base}/v1/models", headers={"Authorization": f"Basic {ALICE}"})
    assert basic.status_code == 401  # the key, but not as a bearer token
    models = _client(server, BOB).models.list()
    assert [m.id for m in models.data] == ["kibidango-tiny"]
    # probes and scrapers need no key
    assert httpx.get(f"{server.base}/health").status_code == 200
    assert httpx.get(f"{server.base}/metrics").status_code == 200


def _chat(server, key: str, session: str, text: str):
    return _client(server, key).chat.completions.create(
        model="kibidango-tiny",
        messages=[{"role": "user", "content": text}],
        max_tokens=4,
        temperature=0,
        extra_headers={"X-Session-Id": session},
    )


def test_session_memory_belongs_to_the_key_that_made_it(server):
    secret = "my card number is 4111 1111 1111 1111"
    first = _chat(server, ALICE, "alice", secret)
    again = _chat(server, ALICE, "alice", "Once upon a time")
    fresh = _chat(server, BOB, "fresh-bob", "Once upon a time")
    thief = _chat(server, BOB, "alice", "Once upon a time")  # the same session id, another key
    assert again.usage.prompt_tokens > fresh.usage.prompt_tokens  # Alice's earlier exchange is in her prompt
    assert thief.usage.prompt_tokens == fresh.usage.prompt_tokens  # ... and nowhere in Bob's
    assert first.choices[0].message.content
    kept = server.memory.context("alice", key_scope(ALICE))
    assert kept[0]["content"] == secret
    assert all(secret not in t["content"] for t in server.memory.context("alice", key_scope(BOB)))


def test_a_session_can_be_forgotten_by_its_own_key_only(server):
    _chat(server, ALICE, "forget-me", "Once upon a time")
    headers = {"Authorization": f"Bearer {BOB}"}
    r = httpx.delete(f"{server.base}/v1/sessions/forget-me", headers=headers)
    assert r.status_code == 200 and r.json()["exchanges"] == 0  # Bob has no such session
    assert server.memory.context("forget-me", key_scope(ALICE))
    r = httpx.delete(f"{server.base}/v1/sessions/forget-me", headers={"Authorization": f"Bearer {ALICE}"})
    assert r.status_code == 200 and r.json() == {
        "id": "forget-me",
        "object": "session",
        "deleted": True,
        "exchanges": 1,
    }
    assert server.memory.context("forget-me", key_scope(ALICE)) == []
    assert httpx.delete(f"{server.base}/v1/sessions/forget-me").status_code == 401
    for bad in ("x" * 129, "a b", "../etc"):
        r = httpx.delete(f"{server.base}/v1/sessions/{bad}", headers=headers)
        assert r.status_code in (400, 404), bad
    r = httpx.post(
        f"{server.base}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"Authorization": f"Bearer {ALICE}", "X-Session-Id": "x" * 129},
    )
    assert r.status_code == 400 and "session id" in r.json()["error"]["message"]


def test_without_keys_only_loopback_is_served(bundle, monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="refusing to serve 0.0.0.0 without API keys"):
        serve(str(bundle), host="0.0.0.0", port=9)
    monkeypatch.delenv("KB_TEST_SERVER_KEY", raising=False)
    with pytest.raises(ValueError, match=r"--api-key-env KB_TEST_SERVER_KEY: the environment variable is not set"):
        load_api_keys("KB_TEST_SERVER_KEY")
    monkeypatch.setenv("KB_TEST_SERVER_KEY", "short")
    with pytest.raises(ValueError, match="shorter than 16") as e:
        load_api_keys("KB_TEST_SERVER_KEY")
    assert "short" not in str(e.value).replace("shorter", "")
    monkeypatch.setenv("KB_TEST_SERVER_KEY", f"{ALICE}, {BOB}")
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"# ours\n{ALICE}\n\nbad key here\n")
    with pytest.raises(ValueError, match=r"keys: line 4 holds whitespace"):
        load_api_keys(None, str(keys_file))
    keys_file.write_text(f"# ours\n{BOB}\n")
    assert load_api_keys("KB_TEST_SERVER_KEY", str(keys_file)) == [ALICE, BOB, BOB]


def test_text_content_parts_are_read_and_other_parts_refused(server):
    client = _client(server, ALICE)
    parts = [{"type": "text", "text": "Once upon"}, {"type": "text", "text": "a time"}]
    joined = client.chat.completions.create(
        model="kibidango-tiny", messages=[{"role": "user", "content": parts}], max_tokens=3, temperature=0
    )
    plain = client.chat.completions.create(
        model="kibidango-tiny", messages=[{"role": "user", "content": "Once upon\na time"}], max_tokens=3, temperature=0
    )
    assert joined.choices[0].message.content == plain.choices[0].message.content
    assert joined.usage.prompt_tokens == plain.usage.prompt_tokens
    image = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="kibidango-tiny", messages=[{"role": "user", "content": image}])
    assert "content[1]: a 'image_url' part; this server reads only text parts" in e.value.message

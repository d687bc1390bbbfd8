"""Session memory: the last 5 exchanges per session, bounded in size, expired after the retention
limit, kept across restarts and shared by threads."""

from __future__ import annotations

import threading

import pytest

from kibidango.cascade.memory import SessionMemory


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        self.now += 1
        return self.now


def test_the_last_five_exchanges_per_session_oldest_first(tmp_path):
    clock = Clock()
    memory = SessionMemory(tmp_path, clock=clock)
    for i in range(7):
        memory.add("alice", f"q{i}", f"a{i}")
    memory.add("bob", "hello", "hi")
    turns = memory.context("alice")
    assert [t["content"] for t in turns] == [x for i in range(2, 7) for x in (f"q{i}", f"a{i}")]
    assert [t["role"] for t in turns[:2]] == ["user", "assistant"]
    assert memory.context("bob") == [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    again = SessionMemory(tmp_path, clock=clock)  # a restart
    assert again.context("alice") == turns and again.context("nobody") == []
    rows = again._db.connection().execute("SELECT COUNT(*) FROM exchanges WHERE session='alice'").fetchone()[0]
    assert rows == 5  # older exchanges are deleted, not just hidden


def test_size_bound_and_retention(tmp_path):
    clock = Clock()
    memory = SessionMemory(tmp_path, max_chars=30, retention_s=100, clock=clock)
    memory.add("s", "a" * 10, "b" * 10)
    memory.add("s", "c" * 10, "d" * 10)
    assert [t["content"][0] for t in memory.context("s")] == ["c", "d"]  # 40 chars: the oldest went
    memory.add("t", "x" * 10, "y" * 50)
    assert sum(len(t["content"]) for t in memory.context("t")) <= 30  # one long exchange: its end
    clock.now += 200
    assert memory.context("s") == [] and memory.purge() == 3
    with pytest.raises(ValueError, match="session id"):
        memory.add("../../etc", "q", "a")


def test_threads_share_one_memory(tmp_path):
    memory = SessionMemory(tmp_path, turns=5)

    def talk(n: int) -> None:
        for i in range(20):
            memory.add(f"s{n % 4}", f"{n}-{i}", "ok")

    threads = [threading.Thread(target=talk, args=(n,)) for n in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for s in range(4):
        assert len(memory.context(f"s{s}")) == 10  # 5 exchanges each, however the writes interleaved

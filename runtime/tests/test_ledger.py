"""The budget ledger under concurrency: two processes x 16 threads share one SQLite ledger; the
spend never passes the limit, and the ledger equals the sum of what the workers settled."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from kibidango.paid.ledger import BudgetExceeded, Ledger, period_of

WORKER = textwrap.dedent(
    """
    import json, random, sys, threading, time
    from kibidango.paid.ledger import BudgetExceeded, Ledger

    state, out, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ledger = Ledger(state, limit_usd=1.00, period="month")
    lock = threading.Lock()
    settled, refused, released = [], 0, 0

    def client(i):
        global refused, released
        rng = random.Random(seed * 100 + i)
        for _ in range(100 // 16 + 1):
            worst = round(rng.uniform(0.005, 0.03), 6)
            try:
                rid = ledger.reserve(worst, note="test")
            except BudgetExceeded:
                with lock:
                    refused += 1
                continue
            time.sleep(rng.uniform(0, 0.002))  # the cloud call
            if rng.random() < 0.1:
                ledger.release(rid)  # failed before billing
                with lock:
                    released += 1
                continue
            cost = round(worst * rng.uniform(0.3, 1.0), 6)
            ledger.settle(rid, cost)
            with lock:
                settled.append(cost)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    json.dump({"settled": settled, "refused": refused, "released": released}, open(out, "w"))
    """
)


def test_two_processes_sixteen_threads_never_pass_the_limit(tmp_path):
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(tmp_path / "state"), str(tmp_path / f"out{i}.json"), str(i)],
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]  # a worker's traceback, if one failed
    results = [json.loads((tmp_path / f"out{i}.json").read_text()) for i in range(2)]
    paid = sum(sum(r["settled"]) for r in results)
    state = Ledger(tmp_path / "state", limit_usd=1.00).state()  # a restart reads the same ledger
    assert state.settled_usd == pytest.approx(paid, abs=1e-9)  # the ledger is the sum of settled costs
    assert state.settled_usd <= 1.00 + 1e-9 and state.reserved_usd == 0
    assert sum(r["refused"] for r in results) > 0  # the budget ran out: the limit was tested
    assert sum(len(r["settled"]) + r["refused"] + r["released"] for r in results) == 2 * 16 * (100 // 16 + 1)


def test_reservations_released_reaped_and_periods(tmp_path):
    ledger = Ledger(tmp_path, limit_usd=0.10, period="day")
    a = ledger.reserve(0.06)
    with pytest.raises(BudgetExceeded, match="does not fit"):
        ledger.reserve(0.05)  # 0.06 reserved: the worst case counts before anything is billed
    ledger.release(a)
    b = ledger.reserve(0.05)
    ledger.settle(b, 0.02)
    assert ledger.state().settled_usd == pytest.approx(0.02) and ledger.state().left_usd == pytest.approx(0.08)
    with pytest.raises(KeyError):
        ledger.settle(b, 0.01)  # settled once only
    # a process killed mid-call: its reservation is charged in full by reap()
    code = (
        f"from kibidango.paid.ledger import Ledger; import os; Ledger({str(tmp_path)!r}, 0.10, "
        "'day').reserve(0.03); os._exit(9)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 9
    assert ledger.state().reserved_usd == pytest.approx(0.03)
    assert ledger.reap() == 1
    assert ledger.state().settled_usd == pytest.approx(0.05) and ledger.state().reserved_usd == 0
    assert period_of("month", 0) == "1970-01" and period_of("total") == "total"
    with pytest.raises(ValueError):
        Ledger(tmp_path, 1.0, period="week")


def test_a_settled_cost_is_never_a_credit(tmp_path):
    ledger = Ledger(tmp_path, limit_usd=1.00, period="total")
    for reported in (-2000.0, float("nan"), float("inf"), None, "0.01", True):
        rid = ledger.reserve(0.05)
        assert ledger.settle(rid, reported) == 0.05, reported  # charged at the worst case
    assert ledger.untrusted == 6
    rid = ledger.reserve(0.05)
    assert ledger.settle(rid, 0.02) == 0.02 and ledger.untrusted == 6  # a credible cost is taken as is
    assert ledger.state().settled_usd == pytest.approx(6 * 0.05 + 0.02)
    for bad in (float("nan"), float("inf"), -1.0, "10"):
        with pytest.raises(ValueError, match="finite, non-negative"):
            Ledger(tmp_path / "x", bad)
        with pytest.raises(ValueError, match="finite, non-negative"):
            ledger.reserve(bad)


def test_a_cost_above_its_reservation_is_recorded_as_reported_and_holds_every_process(tmp_path):
    """The worst case was not the worst case: the reported cost is recorded, never truncated to the
    reservation, and no reservation succeeds (here or in another process on the same state
    directory) until the hold is lifted; the recorded amount stands."""
    from kibidango.paid.ledger import holds, reconcile

    ledger = Ledger(tmp_path, limit_usd=10.00, period="total")
    rid = ledger.reserve(0.098, note="cloud m")
    assert ledger.settle(rid, 0.498) == 0.498 and ledger.over == 1 and ledger.untrusted == 0
    assert ledger.state().settled_usd == pytest.approx(0.498)
    with pytest.raises(BudgetExceeded, match=r"on hold: a reply reported \$0.498000 against a \$0.098000"):
        ledger.reserve(0.01)
    other = subprocess.run(
        [
            sys.executable,
            "-c",
            f"from kibidango.paid.ledger import Ledger; Ledger({str(tmp_path)!r}, 10.0, 'total').reserve(0.01)",
        ],
        capture_output=True,
        text=True,
    )
    assert other.returncode != 0 and "on hold" in other.stderr
    assert [h["note"] for h in holds(tmp_path)] == ["cloud m"]
    assert reconcile(tmp_path, "bill checked") == 1 and holds(tmp_path) == []
    ledger.settle(ledger.reserve(0.01), 0.005)
    assert ledger.state().settled_usd == pytest.approx(0.503)


def test_a_killed_servers_reservation_is_reaped_when_its_successor_has_the_same_pid(tmp_path):
    """Two processes, each PID 1 of its own PID namespace (a container's server, killed with
    kill -9 and restarted): the successor's pid is the dead one's, and its reservation is reaped."""
    import shutil

    unshare = shutil.which("unshare")
    probe = [unshare, "--pid", "--fork", "--mount-proc", sys.executable, "-c", "import os; assert os.getpid() == 1"]
    if not unshare or subprocess.run(probe, capture_output=True).returncode != 0:
        pytest.skip("needs unshare --pid (root, or user namespaces)")
    state = str(tmp_path)
    first = f"import os; from kibidango.paid.ledger import Ledger; Ledger({state!r}, 1.0).reserve(0.25); os._exit(9)"
    assert subprocess.run([*probe[:4], sys.executable, "-c", first]).returncode == 9
    second = (
        f"import json, os; from kibidango.paid.ledger import Ledger; l = Ledger({state!r}, 1.0); assert "
        "os.getpid() == 1;"
        " print(json.dumps([l.reap(), l.state().settled_usd, l.state().reserved_usd]))"
    )
    done = subprocess.run([*probe[:4], sys.executable, "-c", second], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [1, 0.25, 0.0]

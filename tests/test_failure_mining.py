"""Stages 1B (failure mining) and 1C (critique filtering) on real data and a real model: stage 0's
tiny recipe on ../shared, and stories260K (the family's draft tier) standing in for the 1A student.

The 1B run goes through the runner and the store in a child process, as a flow runs it: killed
with SIGKILL mid-run, it publishes nothing, and the rerun generates only the rows not yet judged.
Its general rows are judged by the ``llm`` judge against llama-cpp-python's server on loopback,
with the key in an environment variable: the key is then looked for everywhere the run wrote."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from core.paths import REPO_ROOT
from core.store import ArtifactStore
from eval.shared_data import SHARED
from methods.failures import row_key
from tests.conftest import OPENAI_KEY_ENV, cli_env, needs_shared

STORIES = SHARED / "models" / "stories260K" / "hf"
DATA = SHARED / "data"

CHILD = """
import json, sys
from core.store import Artifact
from flows.runner import RunContext, execute_stage
from stages import load_stage
spec = json.loads(sys.argv[1])
cfg = load_stage(spec["stage"]).Config(**spec["config"])
inputs = {n: Artifact(s, "k-" + n, p, "d-" + n) for n, (s, p) in spec["inputs"].items()}
artifact = execute_stage(spec["stage"], cfg, inputs, RunContext("test", "kibidango-test", spec["store"]))
print("ARTIFACT " + artifact.path)
"""


def _run_stage(spec: dict, env: dict, wait: bool = True) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(spec)],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    if wait:
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-3000:]
        proc.output = out
    return proc


@pytest.fixture(scope="module")
def stage0(tmp_path_factory) -> Path:
    """Stage 0's output for the tiny recipe (real sources; ~5 s)."""
    needs_shared()
    import stages.curate as curate

    out = tmp_path_factory.mktemp("stage0")
    cfg = curate.Config(**yaml.safe_load((REPO_ROOT / "recipes/stage0/tiny.yaml").read_text()))
    curate.run(cfg, {}, out)
    return out


@pytest.fixture(scope="module")
def student(tmp_path_factory) -> Path:
    if not STORIES.is_dir():
        pytest.skip(f"needs {STORIES} (../shared)")
    root = tmp_path_factory.mktemp("student")
    shutil.copytree(STORIES, root / "target")
    return root


def _llm(base_url: str) -> dict:
    """llm judge settings for the loopback server (stories260K: a 512-token context)."""
    return {
        "base_url": base_url,
        "model": "stories260K",
        "api_key_env": OPENAI_KEY_ENV,
        "response_format": "json_object",
        "max_tokens": 48,
        "max_attempts": 1,
        "max_chars": 200,
    }


def _config_1b(base_url: str | None = None) -> dict:
    general = {"kind": "llm", **_llm(base_url)} if base_url else {"kind": "reference", "threshold": 0.4}
    return {
        "samples": [
            {"name": "gsm8k", "source": "gsm8k", "path": str(DATA / "gsm8k/test.jsonl"), "size": 8},
            {"name": "mbpp", "source": "mbpp", "path": str(DATA / "mbpp/mbpp.jsonl"), "size": 8},
            {"name": "humaneval", "source": "humaneval", "path": str(DATA / "humaneval/HumanEval.jsonl.gz"), "size": 4},
            {"name": "general", "source": "stage0", "domain": "general", "size": 12},
        ],
        "judges": {
            "math": {"kind": "math"},
            "code": {"kind": "code", "wall_seconds": 8, "cpu_seconds": 3, "memory_mb": 512},
            "general": general,
        },
        "max_new_tokens": 48,
        "max_judge_error_rate": 1.0,
    }


def test_held_out_rows_are_never_training_rows(stage0):
    from methods.heldout import select_tasks
    from methods.training.chat import load_split
    from stages.mine_failures import Config

    data = stage0 / "dataset"
    train = {row_key(r["instruction"], r["input"]) for r in load_split(data, "train")}
    cfg = Config(**{**_config_1b(), "samples": [{**s, "size": 1000} for s in _config_1b()["samples"]]})
    rows, excluded = select_tasks(cfg, data, train)
    assert not {row_key(r["instruction"], r["input"]) for r in rows} & train
    assert excluded["mbpp"] > 300  # MBPP's mining half is curated: most of it is in the train split
    assert excluded["gsm8k"] == excluded["humaneval"] == 0  # never curated
    assert len({r["id"] for r in rows}) == len(rows)
    general_ids = {r["id"] for r in rows if r["sample"] == "general"}
    held_out = {r["id"] for s in ("validation", "test") for r in load_split(data, s, "general")}
    assert general_ids and general_ids <= held_out


def test_1b_resumes_after_kill_9_and_never_leaks_the_key(stage0, student, openai_server, workspace, tmp_path):
    base_url, key = openai_server
    env = {**cli_env(workspace), OPENAI_KEY_ENV: key}
    store_root = workspace / "store"
    spec = {
        "stage": "1B",
        "config": _config_1b(base_url),
        "inputs": {"student": ["1A", str(student)], "data": ["0", str(stage0)]},
        "store": str(store_root),
    }
    proc = _run_stage(spec, env, wait=False)
    deadline = time.monotonic() + 300
    rows_file = None
    while time.monotonic() < deadline and proc.poll() is None:
        found = list((store_root / "1B").glob(".work-*/rows.jsonl")) if (store_root / "1B").is_dir() else []
        if found and len(found[0].read_text().splitlines()) >= 10:
            rows_file = found[0]
            break
        time.sleep(0.1)
    assert rows_file is not None, f"1B never got to 10 rows: {proc.communicate()[0][-2000:]}"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = len([line for line in rows_file.read_text().splitlines() if line.strip()])
    store = ArtifactStore(store_root)
    assert not list(store.artifacts("1B")), "a killed 1B published an artifact"

    done = _run_stage(spec, env)
    artifact = Path(done.output.split("ARTIFACT ")[-1].strip())
    metrics = json.loads((artifact / "manifest.json").read_text())["metrics"]
    assert metrics["tested"] == 32
    assert metrics["rows_resumed"] >= killed_at - 1  # the line being written at the kill may be torn
    assert metrics["rows_generated"] + metrics["rows_resumed"] == 32
    assert not rows_file.parent.exists(), "the work directory outlived the published artifact"

    from datasets import load_from_disk

    table = load_from_disk(str(artifact / "answers"))
    assert len(table) == 32 and len(set(table["id"])) == 32
    for column in ("id", "domain", "prompt", "answer", "reference", "outcome", "score", "reason", "judge", "tokens"):
        assert column in table.column_names
    assert set(table["judge"]) == {"math", "code", "llm"}
    assert {o for o, j in zip(table["outcome"], table["judge"]) if j == "llm"} <= {"passed", "failed", "judge_error"}
    # Every failure is a verdict: failure rate = failed / judged, judge errors apart.
    stats = json.loads((artifact / "mining.json").read_text())
    assert stats["failed"] + stats["outcomes"].get("passed", 0) + stats["judge_errors"] == 32

    # The MLflow table artifact, and the key nowhere.
    tables = list((workspace / "mlartifacts").rglob("answers.json"))
    assert tables and len(json.loads(tables[0].read_text())["data"]) == 32
    leaks = [
        p
        for p in workspace.rglob("*")
        if p.is_file() and key.encode() in p.read_bytes()  # the store, MLflow's db and artifacts
    ]
    assert not leaks, f"the API key was written to {leaks}"
    assert key not in done.output


def test_1c_funnel_collapses_duplicates_and_keeps_the_most_severe(tmp_path):
    """1C on a handmade 1B table: a near-duplicate cluster keeps its most severe row, each domain
    keeps its top_k, passes and judge errors never enter the funnel's failures."""
    from stages.critique_filter import Config, run

    mined = tmp_path / "mined"
    mined.mkdir()
    rows = []

    def row(i, domain, outcome, score, confidence, prompt, judge="math"):
        rows.append(
            {
                "id": f"r{i}",
                "domain": domain,
                "outcome": outcome,
                "score": score,
                "confidence": confidence,
                "prompt": prompt,
                "answer": "42",
                "reference": "#### 7",
                "reason": "final number 42 differs from the reference 7",
                "judge": judge,
            }
        )

    row(0, "math", "passed", 1.0, 0.9, "Add 3 and 4 apples in a basket for the fair.")
    row(1, "math", "judge_error", 0.0, 0.9, "A reference with no number in it at all here.")
    row(2, "math", "failed", 0.0, 0.2, "Tom has 3 red apples and 4 green apples; how many apples in all?")
    row(3, "math", "failed", 0.0, 0.9, "Tom has 3 red apples and 4 green apples; how many apples in total?")
    row(4, "math", "failed", 0.0, 0.5, "A train leaves at 9 and arrives at 11; how long is the trip?")
    row(5, "math", "failed", 0.0, 0.1, "How many legs do five spiders have together on a wall?")
    row(6, "code", "timeout", 0.0, 0.4, "Write a function that reverses a list.", "code")
    row(7, "code", "failed", 0.5, 0.4, "Write a function that sums the digits of a number.", "code")
    (mined / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    work.mkdir()
    cfg = Config(top_k=2, critique="none", dedup={"threshold": 0.5, "shingle_size": 2})
    result = run(cfg, {"mined": mined}, out, work)
    funnel = json.loads((out / "funnel.json").read_text())
    assert funnel["all"] == {"tested": 8, "judged": 7, "failed": 6, "unique": 5, "critical": 4}
    assert funnel["domains"]["math"] == {"tested": 6, "judged": 5, "failed": 4, "unique": 3, "critical": 2}
    kept = [json.loads(line) for line in (out / "critical.jsonl").read_text().splitlines()]
    ids = {r["id"] for r in kept}
    assert "r3" in ids and "r2" not in ids  # the cluster's more confident (more severe) failure
    assert "r4" in ids and "r5" not in ids  # top 2 of math by severity
    assert {"r6", "r7"} <= ids
    code = {r["id"]: r["severity"] for r in kept if r["domain"] == "code"}
    assert code["r6"] > code["r7"]  # a timeout (score 0) is worse than half the asserts passing
    assert result.metrics["critical"] == 4 and "FAILURE_CARD.md" in result.files_to_log
    assert "| **all** | 8 | 7 | 6 | 5 | **4** |" in (out / "FAILURE_CARD.md").read_text()
    # A cut per domain (the tiny preset's): math keeps one, code both; the card names each cut.
    out2, work2 = tmp_path / "out2", tmp_path / "work2"
    out2.mkdir()
    work2.mkdir()
    per_domain = cfg.model_copy(update={"top_k": {"math": 1, "code": 2}})
    again = run(per_domain, {"mined": mined}, out2, work2)
    assert again.metrics["critical"] == 3 and "(top math 1, code 2 per domain;" in again.summary
    assert "Kept: the math 1, code 2 most severe" in (out2 / "FAILURE_CARD.md").read_text()


def test_1c_per_level_shares_keep_a_level_severity_alone_would_leave_out(tmp_path):
    """``per_level``: a domain's top_k is shared among its ladder levels in proportion to their
    unique failures, the most severe of each level first; a level with low confidence (the edge of
    what the student can do) is no longer crowded out by a level it is sure of and wrong at."""
    from stages.critique_filter import Config, run

    mined = tmp_path / "mined"
    mined.mkdir()
    rows = []
    words = ["apples", "pears", "plums", "figs", "limes", "kiwis", "dates", "grapes", "melons", "berries"]
    for i in range(10):  # level 4: five failures the student was unsure of; level 5: five it was sure of
        level = 4 if i < 5 else 5
        rows.append(
            {
                "id": f"L{level}-{i}",
                "domain": "math",
                "level": level,
                "outcome": "failed",
                "score": 0.0,
                "confidence": 0.3 + 0.01 * i if level == 4 else 0.9 + 0.001 * i,
                "prompt": f"Sam buys {i + 3} bags of {words[i]} with {2 * i + 5} {words[i]} each on day {i}.",
                "answer": "#### 1",
                "reference": "#### 7",
                "reason": "wrong",
                "judge": "math",
            }
        )
    rows.append(
        {
            **rows[0],
            "id": "gsm",
            "level": None,
            "prompt": "Gsm: a bakery sold 40 loaves before noon.",
            "confidence": 0.95,
        }
    )
    (mined / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def kept(per_level: bool, top_k: int) -> tuple[list[str], dict]:
        out, work = tmp_path / f"out-{per_level}-{top_k}", tmp_path / f"work-{per_level}-{top_k}"
        out.mkdir()
        work.mkdir()
        cfg = Config(top_k=top_k, critique="none", per_level=per_level, dedup={"threshold": 0.9, "shingle_size": 2})
        run(cfg, {"mined": mined}, out, work)
        funnel = json.loads((out / "funnel.json").read_text())
        return [json.loads(line)["id"] for line in (out / "critical.jsonl").read_text().splitlines()], funnel

    alone, _ = kept(False, 6)
    assert sum(i.startswith("L4") for i in alone) == 0  # severity alone: level 5 and the no-level task only
    # of 11 unique failures, 6 places: level 4 6 x 5 / 11 = 2.7 -> 3, level 5 2.7 -> 3, no level 0.5 -> 0
    shared, funnel = kept(True, 6)
    assert sorted(shared) == ["L4-2", "L4-3", "L4-4", "L5-7", "L5-8", "L5-9"]  # each level's most severe
    assert funnel["per_level"] and funnel["levels"]["math"] == {"4": 3, "5": 3}
    assert "Kept per level: math L4 3, L5 3" in (tmp_path / "out-True-6" / "FAILURE_CARD.md").read_text()
    everything, _ = kept(True, 50)  # a top_k above the failures keeps them all
    assert len(everything) == 11


def test_1c_llm_critic_is_resumable_and_only_disputes_the_weak_judge(openai_server, monkeypatch, tmp_path):
    """1C with an LLM critic (llama-cpp-python's server on loopback): every kept failure has a
    critique or the critic's error; a critic's "passed" drops a chrF-judged failure, never a
    verifiable one; a rerun on the same work directory asks the critic nothing again."""
    from stages.critique_filter import Config, run

    base_url, key = openai_server
    monkeypatch.setenv(OPENAI_KEY_ENV, key)
    mined = tmp_path / "mined"
    mined.mkdir()
    rows = []
    for i in range(6):
        judge = "reference" if i % 2 else "math"
        rows.append(
            {
                "id": f"r{i}",
                "domain": "general" if i % 2 else "math",
                "outcome": "failed",
                "score": 0.1 * i,
                "confidence": 0.5,
                "prompt": f"Task number {i}: name {i + 2} colours of the rainbow, one per line.",
                "answer": "Red.",
                "reference": "Red, orange, yellow, green, blue.",
                "reason": "chrF++ 0.2 < threshold 0.4" if judge == "reference" else "final number 1 differs",
                "judge": judge,
            }
        )
    (mined / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = Config(top_k=5, critique="llm", critic=_llm(base_url), dedup={"threshold": 0.9})
    work = tmp_path / "work"
    work.mkdir()
    outs = []
    for attempt in (1, 2):
        out = tmp_path / f"out{attempt}"
        out.mkdir()
        outs.append((run(cfg, {"mined": mined}, out, work), out))
    (first, out1), (second, out2) = outs
    notes = [json.loads(line) for line in (work / "critiques.jsonl").read_text().splitlines()]
    assert len(notes) == 6 and second.metrics["critiques_resumed"] == 6 and first.metrics["critiques_resumed"] == 0
    assert all(n.get("critique") or n.get("critic_error") for n in notes)
    kept = [json.loads(line) for line in (out1 / "critical.jsonl").read_text().splitlines()]
    disputed = {n["id"] for n in notes if n.get("passed") and rows[int(n["id"][1:])]["judge"] == "reference"}
    assert {r["id"] for r in kept} == {r["id"] for r in rows} - disputed
    assert first.metrics["disputed"] == len(disputed)
    assert (out1 / "critical.jsonl").read_text() == (out2 / "critical.jsonl").read_text()
    assert key not in (work / "critiques.jsonl").read_text()


def test_1r_retrains_on_corrected_pairs_and_measures_the_held_out_failures(stage0, student, tmp_path):
    """The retraining round with real axolotl on stories260K (4 steps): trains on the pairs plus
    replay rows, never on a held-out failure, and judges the held-out failures before and after;
    the two controls train with the same budget (random mined tasks with gold answers; replay
    only), and 1A, the controls and 1R answer the same evaluation tasks, compared by McNemar."""
    from tests.test_training_resume import _needs_axolotl_and_shared

    _needs_axolotl_and_shared()
    from methods.benchmarks import load_tasks
    from stages.retrain import Config, run

    tasks = load_tasks("gsm8k", DATA / "gsm8k/test.jsonl", "mining")[:16]

    def row(bt, answer=None):
        instruction, input_ = bt.instruction()
        r = {"id": bt.id, "domain": "math", "instruction": instruction, "input": input_, "prompt": bt.task.prompt}
        r.update(reference=bt.task.reference, tests=[], entry_point="", setup="")
        return {**r, "output": answer} if answer is not None else r

    pairs_dir, mined = tmp_path / "pairs", tmp_path / "mined"
    pairs_dir.mkdir()
    mined.mkdir()
    pairs = [row(bt, bt.task.reference) | {"tier": "gold"} for bt in tasks[:6]]
    held = [row(bt) for bt in tasks[6:10]]
    (pairs_dir / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    (pairs_dir / "held_out.jsonl").write_text("".join(json.dumps(h) + "\n" for h in held))
    (mined / "manifest.json").write_text(json.dumps({"config": {"judges": {"math": {"kind": "math"}}}}))
    answered = [row(bt) | {"passed": False} for bt in tasks[:10]]  # 1B's answers: pairs, held out and 6
    answered += [row(bt) | {"passed": True, "answer": bt.task.reference} for bt in tasks[10:]]  # it passed
    (mined / "answers.jsonl").write_text("".join(json.dumps(a) + "\n" for a in answered))
    train = {"max_steps": 4, "micro_batch_size": 2, "sequence_len": 128, "learning_rate": 0.001, "warmup_steps": 1}
    train.update(logging_steps=1, save_steps=2)
    evaluation = [{"name": "ladder_math", "source": "ladder", "domain": "math", "levels": [1, 2], "size": 4}]
    cfg = Config(
        replay_share=0.5,
        replay_own=0.5,  # half the replay rows its own passes: 6 wanted, 1B passed 6
        pair_repeats=2,
        train=train,
        max_new_tokens=24,
        parallel=3,  # the answers of 1A, the controls and 1R decode batched, from threads
        tokenizer_type="LlamaTokenizer",
        evaluation=evaluation,
    )
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    work.mkdir()
    inputs = {"student": student, "pairs": pairs_dir, "mined": mined, "data": stage0}
    result = run(cfg, inputs, out, work)
    m = result.metrics
    assert m["pairs"] == 6 and m["replay_rows"] == 12 and m["held_out"] == 4 and m["replay_own_rows"] == 6
    assert 0 <= m["failure_rate_after"] <= 1 and m["failure_rate_before"] == 1.0  # a story model gets no sum right
    assert m["val_perplexity_before"] > 1 and m["val_perplexity_after"] > 1  # the forgetting guard is measured
    trained = (work / "data" / "train.jsonl").read_text()
    assert all(h["instruction"] not in trained for h in held)  # never trained on a held-out failure
    card = (out / "RETRAIN_CARD.md").read_text()
    assert (out / "target" / "config.json").is_file() and "| **all** | 4 |" in card
    # The controls: the same number of rows, the same replay rows; random draws from what 1B answered.
    mix = trained.splitlines()
    random_mix = (work / "controls" / "random" / "train.jsonl").read_text().splitlines()
    replay_mix = (work / "controls" / "replay" / "train.jsonl").read_text().splitlines()
    assert len(random_mix) == len(replay_mix) == len(mix) == 24 and random_mix[12:] == mix[12:]
    taught = {m["content"] for line in random_mix for m in json.loads(line)["messages"]}
    assert not any(h["prompt"] in taught for h in held)
    drawn = {m["content"] for line in random_mix[:12] for m in json.loads(line)["messages"]}
    assert any(bt.task.prompt in drawn for bt in tasks[10:])  # not only the failures: drawn blindly
    rehearsed = {m["content"] for line in mix[12:] for m in json.loads(line)["messages"]}
    assert sum(bt.task.prompt in rehearsed for bt in tasks[10:]) == 6  # its own passes, in the replay rows
    assert (out / "logs" / "random.log").is_file() and (out / "logs" / "replay.log").is_file()
    verdicts = [json.loads(line) for line in (out / "evaluation.jsonl").read_text().splitlines()]
    assert len(verdicts) == 4 and all(set(v["passed"]) == {"1A", "1R", "random", "replay"} for v in verdicts)
    assert {v["level"] for v in verdicts} == {1, 2} and all(v["id"].startswith("ladder-math-") for v in verdicts)
    for control in ("1A", "random", "replay"):
        assert 0 <= m[f"mcnemar/1R_vs_{control}/p"] <= 1 and f"1R vs {control}" in card
    assert 0 <= m["eval/1R/ladder_math/L2"] <= 1 and "McNemar" in card

    # The study (1S, `make study-loop`): 1R's own model (not trained again) beside the other arms:
    # gold-only (the same failures, their gold answers) and half of the pairs (the same replay rows).
    study = cfg.model_copy(update={"controls": ["gold", "pairs50"]})
    s_out, s_work = tmp_path / "s_out", tmp_path / "s_work"
    s_out.mkdir()
    s_work.mkdir()
    studied = run(study, {**inputs, "retrained": out}, s_out, s_work)
    assert not (s_work / "sft").exists() and not (s_out / "target").exists()  # 1R itself was not retrained
    gold_mix = (s_work / "controls" / "gold" / "train.jsonl").read_text().splitlines()
    half_mix = (s_work / "controls" / "pairs50" / "train.jsonl").read_text().splitlines()
    assert len(gold_mix) == 24 and gold_mix[12:] == mix[12:] and len(half_mix) == 3 * 2 + 12
    taught = [json.loads(line)["messages"][-1]["content"] for line in gold_mix[:12]]
    assert sorted(taught) == sorted(p["reference"] for p in pairs for _ in range(2))
    verdicts = [json.loads(line) for line in (s_out / "evaluation.jsonl").read_text().splitlines()]
    assert all(set(v["passed"]) == {"1A", "1R", "gold", "pairs50"} for v in verdicts)
    first = {v["id"]: v["passed"]["1R"] for v in map(json.loads, (out / "evaluation.jsonl").read_text().splitlines())}
    assert {v["id"]: v["passed"]["1R"] for v in verdicts} == first  # the same model, the same answers
    assert 0 <= studied.metrics["mcnemar/1R_vs_gold/p"] <= 1


def test_1r_preference_objective_prefers_the_correction_to_the_students_own_mistake(stage0, student, tmp_path):
    """1R with ``preference`` (axolotl's DPO + NLL, real, on stories260K): each pair's rejected reply is
    the answer 1B failed it on, a replay row is its own rejected reply (an SFT row), no lone story
    enters (it has no prompt), the gold control gets the same rejected replies, and TRL tokenizes the
    rows as the SFT path does (its mismatch warning never appears)."""
    from tests.test_training_resume import _needs_axolotl_and_shared

    _needs_axolotl_and_shared()
    from methods.benchmarks import load_tasks
    from stages.retrain import Config, run

    tasks = load_tasks("gsm8k", DATA / "gsm8k/test.jsonl", "mining")[:10]

    def row(bt, **more):
        instruction, input_ = bt.instruction()
        r = {"id": bt.id, "domain": "math", "instruction": instruction, "input": input_, "prompt": bt.task.prompt}
        return r | {"reference": bt.task.reference, "tests": [], "entry_point": "", "setup": ""} | more

    pairs_dir, mined = tmp_path / "pairs", tmp_path / "mined"
    pairs_dir.mkdir()
    mined.mkdir()
    pairs = [row(bt, output=bt.task.reference, tier="gold") for bt in tasks[:4]]
    (pairs_dir / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    (pairs_dir / "held_out.jsonl").write_text("".join(json.dumps(row(bt)) + "\n" for bt in tasks[4:6]))
    (mined / "manifest.json").write_text(json.dumps({"config": {"judges": {"math": {"kind": "math"}}}}))
    answered = [row(bt, passed=False, answer=f"It is {i + 100}.\n#### {i + 100}") for i, bt in enumerate(tasks)]
    (mined / "answers.jsonl").write_text("".join(json.dumps(a) + "\n" for a in answered))
    train = {"max_steps": 2, "micro_batch_size": 2, "sequence_len": 192, "learning_rate": 0.001, "warmup_steps": 0}
    train.update(logging_steps=1, save_steps=2, axolotl={"group_by_length": True})
    cfg = Config(
        replay_share=0.5,
        train=train,
        preference={"beta": 0.1, "nll_weight": 1.0},
        controls=["gold"],
        max_new_tokens=8,
        tokenizer_type="LlamaTokenizer",
    )
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    work.mkdir()
    result = run(cfg, {"student": student, "pairs": pairs_dir, "mined": mined, "data": stage0}, out, work)
    assert result.metrics["pairs"] == 4 and result.metrics["replay_rows"] == 4
    rows = [json.loads(line) for line in (work / "data" / "train.jsonl").read_text().splitlines()]
    assert all(set(r) == {"prompt", "chosen", "rejected"} and r["prompt"] for r in rows)
    assert [r["rejected"] for r in rows[:4]] == [f"It is {i + 100}.\n#### {i + 100}</s>" for i in range(4)]
    assert all(r["rejected"] == r["chosen"] for r in rows[4:])  # replay: the NLL term alone
    assert all(r["prompt"].endswith("### Response:\n") and not r["prompt"].startswith("<s>") for r in rows)
    gold = [json.loads(line) for line in (work / "controls" / "gold" / "train.jsonl").read_text().splitlines()]
    assert [r["rejected"] for r in gold[:4]] == [r["rejected"] for r in rows[:4]] and gold[4:] == rows[4:]
    spec = (out / "axolotl.yaml").read_text()
    assert "rl: dpo" in spec and "- sft" in spec and "type: passthrough" in spec
    assert "group_by_length: false" in spec  # TRL's preference rows have no input_ids to sort by
    log = (out / "logs" / "train.log").read_text()
    assert "Mismatch between tokenized prompt" not in log and "rewards/margins" in log
    assert (out / "target" / "config.json").is_file()
    assert "Objective: DPO beta 0.1 + NLL x1 " in (out / "RETRAIN_CARD.md").read_text()


def test_a_lora_starts_from_the_recipe_seed(tmp_path):
    """Two runs of one recipe with a LoRA (real axolotl on stories260K) train the same adapter, by
    preference (DPO + NLL) and by SFT: axolotl's loader and TRL's DPOTrainer draw the LoRA before the
    Trainer seeds (two runs' A matrices were uncorrelated), so ``kibidango_lora_seed.SeedLoRA`` redraws
    it from the recipe's seed; another seed starts elsewhere."""
    import numpy as np
    from safetensors.numpy import load_file

    from methods.training.finetune import fine_tune, preference_recipe
    from methods.training.recipe import PreferenceSpec, TrainRecipe
    from tests.test_training_resume import _needs_axolotl_and_shared

    _needs_axolotl_and_shared()
    pref, sft = tmp_path / "pref.jsonl", tmp_path / "sft.jsonl"
    asks = [(f"Add {i} and {i}.", f"{2 * i}.", f"{2 * i + 1}.") for i in range(8)]
    prompt = "### Instruction:\n{}\n\n### Response:\n"
    rows = [{"prompt": prompt.format(q), "chosen": f"{a}</s>", "rejected": f"{b}</s>"} for q, a, b in asks]
    pref.write_text("".join(json.dumps(r) + "\n" for r in rows))
    chats = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a, _ in asks]
    sft.write_text("".join(json.dumps(r) + "\n" for r in chats))
    train = dict(max_steps=1, micro_batch_size=2, sequence_len=64, learning_rate=1e-3, warmup_steps=0)
    train.update(logging_steps=1, save_steps=5, adapter="lora")

    def adapter(run: str, seed: int, preference: bool) -> dict:
        recipe = TrainRecipe(**train, seed=seed)
        if preference:
            recipe = preference_recipe(recipe, PreferenceSpec(beta=0.1), str(pref))
        work, out = tmp_path / f"w{run}", tmp_path / f"o{run}"
        work.mkdir()
        out.mkdir()
        data = pref if preference else sft
        model, _ = fine_tune(recipe, STORIES, data, work, out, "target", run, tokenizer="LlamaTokenizer")
        assert "- kibidango_lora_seed.SeedLoRA" in (out / "axolotl.yaml").read_text()
        return load_file(str(next(model.glob("*.safetensors"))))

    for preference in (True, False):
        kind = "dpo" if preference else "sft"
        a, b, other = (adapter(f"{kind}{n}", seed, preference) for n, seed in ((1, 5), (2, 5), (3, 6)))
        lora_a = sorted(k for k in a if "lora_A" in k)
        assert lora_a and set(a) == set(b), kind
        assert all(np.array_equal(a[k], b[k]) for k in a), kind
        assert not any(np.array_equal(a[k], other[k]) for k in lora_a), kind


def test_preference_tiers_reject_only_the_on_policy_pairs(tmp_path):
    """``preference.tiers``: only a pair from a listed 1D tier (the student's own sampled answer as the
    chosen reply) takes 1B's failed answer as its rejected one; a gold pair, a control's row (no tier)
    and a task the student passed train by the NLL term alone; without ``tiers`` every failed row does;
    a mix where no row has a rejected answer trains by plain SFT."""
    from stages.retrain import Config, _failed_answers, _objective, _training_file, _with_rejected

    answered = [
        {"id": "a", "passed": False, "answer": "wrong a"},
        {"id": "b", "passed": False, "answer": "wrong b"},
        {"id": "c", "passed": False, "answer": "wrong c"},
        {"id": "d", "passed": True, "answer": "right d"},
    ]
    rows = [{"id": "a", "tier": "self"}, {"id": "b", "tier": "gold"}, {"id": "c"}, {"id": "d", "tier": "self"}]
    failed = _failed_answers(answered)
    train = {"max_steps": 1}
    on_policy = Config(train=train, preference={"tiers": ["self", "self-hint"]})
    assert [r["rejected"] for r in _with_rejected(on_policy, rows, failed)] == ["wrong a", None, None, None]
    every = Config(train=train, preference={})
    assert [r["rejected"] for r in _with_rejected(every, rows, failed)] == ["wrong a", "wrong b", "wrong c", None]
    assert _objective(on_policy) == "DPO beta 0.1 + NLL x1 (rejected on self, self-hint pairs)"
    assert _objective(Config(train=train)) == "SFT"
    with pytest.raises(ValueError):
        Config(train=train, preference={"tiers": []})
    # a mix with no rejected answer (a control's gold rows) trains by SFT: chat rows, 1R's own recipe
    path = tmp_path / "train.jsonl"
    row = {"id": "c", "instruction": "2 + 2?", "input": "", "output": "4", "rejected": None}
    assert _training_file(on_policy, None, path, [row]) == on_policy.train
    assert set(json.loads(path.read_text())) == {"messages"}


def test_the_students_own_passes_are_rehearsed_in_the_replay_share():
    """1R's replay share may hold the student's own passing answers (STaR's rehearsal): per domain in
    the pairs' proportions and as many as 1B passed, the rest from stage 0; never a failure, an
    excluded (held-out) id, a right number reached by wrong working or a format failure."""
    from methods.failures import loop_mix, own_passes

    def answer(i, domain, **kw):
        row = {"id": i, "domain": domain, "instruction": f"q {i}", "input": "", "answer": f"a {i}", "passed": True}
        return row | kw

    answered = [answer(f"m{i}", "math") for i in range(10)] + [answer(f"c{i}", "code") for i in range(2)]
    answered += [answer("f", "math", passed=False), answer("w", "math", wrong_working=True)]
    answered += [answer("x", "code", format_failure=True), answer("h", "math")]
    own = own_passes(answered, exclude={"h"})
    assert sorted(r["id"] for r in own) == sorted([*(f"m{i}" for i in range(10)), "c0", "c1"])
    assert own[0] == {"id": "m0", "domain": "math", "instruction": "q m0", "input": "", "output": "a m0"}

    pairs = [{"id": f"p{i}", "domain": d} for i, d in enumerate(["math"] * 6 + ["code"] * 6)]
    stage0 = [{"id": f"s{i}", "domain": "general"} for i in range(50)]
    rows, replay = loop_mix(pairs, stage0, 0.5, 1, 3, own=own, own_share=1.0)
    kinds = Counter(r["id"][0] for r in replay)
    assert rows == pairs and len(replay) == 12  # math: 6 of its 10; code: 6 wanted, 2 passed; stage 0 the rest
    assert kinds == {"m": 6, "c": 2, "s": 4}
    _, half = loop_mix(pairs, stage0, 0.5, 1, 3, own=own, own_share=0.5)
    assert Counter(r["id"][0] for r in half) == {"m": 3, "c": 2, "s": 7}
    assert loop_mix(pairs, stage0, 0.5, 1, 3, own=own)[1] == loop_mix(pairs, stage0, 0.5, 1, 3)[1]  # share 0


def test_an_answer_that_cannot_start_has_no_confidence(student):
    """A prompt that fills the student's context gets no answer: confidence 0, so it never ranks as
    a confidently wrong failure."""
    from methods.measure.generate import Answerer

    answerer = Answerer(student / "target", max_new_tokens=8)
    empty = answerer("word " * 2000)
    assert (empty.text, empty.tokens, empty.finish_reason, empty.mean_logprob, empty.confidence) == (
        "",
        0,
        "context",
        None,
        0.0,
    )
    some = answerer("Once upon a time")
    assert some.tokens > 0 and 0 < some.confidence <= 1 and some.mean_logprob < 0


def test_answers_decoded_together_are_the_answers_decoded_alone(student):
    """``Answerer(parallel=4)`` called from 8 threads batches their decoding (the runtime's
    Batcher) and gives each caller what one-at-a-time decoding gives (float64 weights: batched
    and single forwards agree to rounding far below any near-tie)."""
    from concurrent.futures import ThreadPoolExecutor

    from methods.measure.generate import Answerer

    alone = Answerer(student / "target", max_new_tokens=20)
    together = Answerer(student / "target", max_new_tokens=20, parallel=4)
    for a in (alone, together):
        a.model.hf.double()
    things = ("a cat", "a dog", "the sea", "a tall tree", "rain", "a red boat", "the moon", "a little girl who sang")
    prompts = [f"Tell me a story about {t}." for t in things]
    want = [alone(p) for p in prompts]
    try:
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(together, prompts))
        stats = together.batcher.stats
    finally:
        together.close()
    assert [a.text for a in got] == [a.text for a in want] and all(a.tokens > 0 for a in got)
    assert all(abs(a.mean_logprob - b.mean_logprob) < 1e-9 for a, b in zip(got, want))
    assert stats.feeds > stats.forwards  # forwards were shared
    assert together.pipeline.models["target"] is together.model  # closed: the pipeline decodes alone again


def test_answers_are_journaled_as_they_finish_and_a_rerun_answers_only_the_rest(tmp_path):
    """Tasks answered in parallel: one that takes long holds back no other's row, so a run killed
    while it decodes keeps the rows that finished after it started, and the rerun answers it alone."""
    from methods.heldout import answer_and_judge

    rows = [{"id": f"t{i}", "domain": "math"} for i in range(4)]
    journal = tmp_path / "rows.jsonl"

    def slow_then_killed(row, prior, judge):
        if row["id"] == "t0":  # still decoding when the others finish; then the run dies
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and (not journal.exists() or len(journal.read_text().splitlines()) < 3):
                time.sleep(0.05)
            raise RuntimeError("killed while t0 decoded")
        return {"id": row["id"], "retryable": False, "answer": judge(row)}

    with pytest.raises(RuntimeError, match="killed"):
        answer_and_judge({"math": lambda row: "ok"}, rows, tmp_path, "test answers", slow_then_killed, parallel=4)
    assert sorted(json.loads(line)["id"] for line in journal.read_text().splitlines()) == ["t1", "t2", "t3"]

    answered = []

    def again(row, prior, judge):
        answered.append(row["id"])
        return {"id": row["id"], "retryable": False, "answer": judge(row)}

    out, resumed = answer_and_judge({"math": lambda row: "ok"}, rows, tmp_path, "test answers", again, parallel=4)
    assert answered == ["t0"] and resumed == 3
    assert [r["id"] for r in out] == ["t0", "t1", "t2", "t3"]


def test_right_numbers_reached_by_wrong_working_are_counted_apart():
    """With the recipe's math judge reading the working, an answer whose final number is right but
    whose own arithmetic is wrong fails; 1B's figures and card count those apart (an answer wrong in
    its number too is a plain wrong answer)."""
    from methods.failures import verdict_record
    from methods.judges import Task, make_judge
    from stages.mine_failures import Config, _card, _figures

    judge = make_judge({"kind": "math", "working": True})
    task = Task("t", "?", reference="41 + 17 = 58\n#### 58")
    lucky = verdict_record(judge(task, "41 + 57 = 58\n#### 58"), "math")
    wrong = verdict_record(judge(task, "41 + 57 = 59\n#### 59"), "math")
    assert lucky["outcome"] == "failed" and lucky["wrong_working"] and "41 + 57 = 58" in lucky["reason"]
    assert wrong["outcome"] == "failed" and not wrong["wrong_working"] and "differs" in wrong["reason"]
    right = verdict_record(judge(task, "41 + 17 = 58\n#### 58"), "math")
    table = [
        {"id": f"r{i}", "sample": "s", "domain": "math", "tokens": 5, "finish_reason": "stop", **record}
        for i, record in enumerate([lucky, wrong, right])
    ]
    cfg = Config.model_validate(
        {
            "samples": [{"name": "s", "source": "gsm8k", "path": "gsm8k.jsonl", "size": 3}],
            "judges": {"math": {"kind": "math", "working": True}},
        }
    )
    metrics, stats = _figures(cfg, table, {}, 3, 0, 0, 1.0)
    assert metrics["wrong_working"] == 1 and stats["failed"] == 2 and stats["domains"]["math"]["wrong_working"] == 1
    assert "| math | math | 3 | 3 | 2 | 0 | 1 | 66.7% |" in _card(stats)


def test_format_failures_are_counted_apart_from_wrong_answers():
    """An answer whose code could not be found or parsed failed its format, not its task: 1B's
    figures and card count those apart (the code judge marks them ``format_failure``)."""
    from methods.failures import verdict_record
    from methods.judges import Task, make_judge
    from stages.mine_failures import Config, _card, _figures

    judge = make_judge("code", weak_sandbox_ok=True)
    task = Task("t", "?", tests=("assert add(1, 2) == 3",))
    unformatted = verdict_record(judge(task, "I am not able to write this."), "code")
    assert unformatted["outcome"] == "error" and unformatted["format_failure"]

    def row(i, record):
        return {"id": f"r{i}", "sample": "s", "domain": "code", "tokens": 5, "finish_reason": "stop", **record}

    wrong = {"outcome": "failed", "passed": False, "score": 0.0, "judge_usd": 0.0, "format_failure": False}
    table = [row(0, unformatted), row(1, wrong), row(2, {**wrong, "outcome": "passed", "passed": True})]
    cfg = Config.model_validate(
        {
            "samples": [{"name": "s", "source": "mbpp", "path": "mbpp.jsonl", "domain": "code", "size": 3}],
            "judges": {"code": {"kind": "code"}},
        }
    )
    metrics, stats = _figures(cfg, table, {}, 3, 0, 0, 1.0)
    assert metrics["format_failures"] == 1 and stats["failed"] == 2 and stats["domains"]["code"]["format_failures"] == 1
    assert "of which format (no runnable code)" in _card(stats)


def test_the_band_is_chosen_on_the_mining_part_from_the_students_own_rates():
    """A band sample mines where the student passes between `low` and `high`, measured by a probe
    of every level's mining tasks; a student that passes nothing mines where it is nearest."""
    from methods.heldout import Band, choose_band

    band = Band(low=0.1, high=0.9, probe=10)
    rates = {1: (10, 10), 2: (9, 10), 3: (5, 10), 4: (1, 10), 5: (0, 10), 6: (0, 10)}
    assert choose_band(rates, band) == [2, 3, 4]
    assert choose_band({1: (0, 10), 2: (0, 10)}, band) == [1]  # nothing passes: the lowest level
    assert choose_band({1: (10, 10), 2: (10, 10), 3: (10, 10)}, band) == [1]  # everything passes: nearest
    with pytest.raises(ValueError, match="above high"):
        Band(low=0.9, high=0.1)


def test_the_levels_above_the_band_stop_at_the_ladders_top():
    """`above`: the levels just above the band's highest are mined too, never past the top level."""
    from methods.heldout import levels_above

    assert levels_above([2, 4], 1, 6) == [5]
    assert levels_above([2, 3], 2, 7) == [4, 5]
    assert levels_above([5, 6], 1, 6) == []  # the band reaches the top: nothing above it
    assert levels_above([1, 2], 0, 6) == [] and levels_above([], 1, 6) == []


def test_stage_1b_probes_every_level_then_mines_the_band(stage0, student, tmp_path):
    from stages.mine_failures import Config, run

    cfg = Config.model_validate(
        {
            "samples": [{"name": "lm", "source": "ladder", "domain": "math", "band": {"probe": 2}, "size": 3}],
            "judges": {"math": {"kind": "math"}},
            "max_new_tokens": 8,
        }
    )
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    work.mkdir()
    result = run(cfg, {"data": stage0, "student": student}, out, work)
    stats = json.loads((out / "mining.json").read_text())
    band = stats["bands"]["lm"]
    assert len(band["probe"]) == 7 and all(p["answered"] == 2 for p in band["probe"].values())  # every level
    assert band["levels"] == [1]  # a story model passes no arithmetic: mined where it is nearest
    rows = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    assert len(rows) == 2 + 3 and {r["level"] for r in rows} == {1}  # the probe's level-1 tasks, then 3 more
    probed = [json.loads(line) for line in (work / "rows.jsonl").read_text().splitlines()]
    assert len(probed) == 7 * 2 + 3  # the band's probe rows were not answered twice
    assert result.metrics["rows_probe_reused"] == 2 and result.metrics["rows_resumed"] == 0  # nothing interrupted
    assert result.metrics["rows_generated"] == 7 * 2 + 3
    assert result.metrics["band/lm/lowest"] == 1 and "Band of `lm`" in (out / "MINING_CARD.md").read_text()


def test_stage_1b_mines_the_level_above_the_band_when_asked(stage0, student, tmp_path):
    """`band.above: 1`: the band's level and the one above it are mined (the probe's tasks of both
    first), the band itself stays what the probe chose (the evaluation's `above` counts from it), and
    the card marks which level was mined as what."""
    from stages.mine_failures import Config, run

    cfg = Config.model_validate(
        {
            "samples": [
                {"name": "lm", "source": "ladder", "domain": "math", "band": {"probe": 2, "above": 1}, "size": 4}
            ],
            "judges": {"math": {"kind": "math"}},
            "max_new_tokens": 8,
        }
    )
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    work.mkdir()
    run(cfg, {"data": stage0, "student": student}, out, work)
    band = json.loads((out / "mining.json").read_text())["bands"]["lm"]
    assert band["levels"] == [1] and band["above"] == [2]
    rows = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 2 + 4 and {r["level"] for r in rows} == {1, 2}
    probed = [json.loads(line) for line in (work / "rows.jsonl").read_text().splitlines()]
    assert len(probed) == 7 * 2 + 4  # the probe's rows of both levels were not answered twice
    card = (out / "MINING_CARD.md").read_text()
    assert "Mined too, above the band: level 2" in card and "| 1 | 0 / 2 |" in card and "| band |" in card


def test_round_2_mines_no_task_round_1_answered(stage0, student, tmp_path):
    """Round 2's 1B reads round 1's (`previous`): the tasks round 1 answered (its probe's too) are
    never drawn again, and what it answered joins the list for round 3."""
    from stages.mine_failures import Config, run

    cfg = Config.model_validate(
        {
            "samples": [
                {"name": "lm", "source": "ladder", "domain": "math", "band": {"probe": 1}, "size": 2},
                {"name": "lc", "source": "ladder", "domain": "code", "levels": [1, 2], "size": 2},
            ],
            "judges": {"math": {"kind": "math"}, "code": {"kind": "code", "weak_sandbox_ok": True}},
            "max_new_tokens": 8,
        }
    )
    outs = []
    for r in (1, 2):
        out, work = tmp_path / f"out{r}", tmp_path / f"work{r}"
        out.mkdir()
        work.mkdir()
        inputs = {"data": stage0, "student": student, **({"previous": outs[-1]} if outs else {})}
        result = run(cfg, inputs, out, work)
        assert result.metrics["round"] == r
        outs.append(out)
    first, second = (json.loads((o / "answered_tasks.json").read_text()) for o in outs)
    round_2 = {json.loads(line)["id"] for line in (outs[1] / "answers.jsonl").read_text().splitlines()}
    assert round_2 and not round_2 & set(first["ids"]) and len(first["ids"]) == 7 + 2 + 2  # probe, band, lc
    assert second["round"] == 2 and set(first["ids"]) | round_2 <= set(second["ids"])


def test_an_adapter_ships_only_if_it_beats_the_weights_it_modifies(stage0, student, tmp_path):
    """Stages 3-5 with a `check`: the target answers held-out tasks of the domain with and without
    the adapter (tasks 1B mined excluded); a LoRA on a story model is no better at arithmetic, so it
    does not ship, and the router (6A) routes none of its domain's queries to it."""
    from tests.test_training_resume import _needs_axolotl_and_shared

    _needs_axolotl_and_shared()
    from methods.training.adapter_manifest import ships
    from stages import domain_lora, train_router

    mined = tmp_path / "mined"
    mined.mkdir()
    from methods.ladder import ladder_rows

    taken = [r["id"] for r in ladder_rows("math", [1], "mining", 3, 0)]
    (mined / "answered_tasks.json").write_text(json.dumps({"round": 1, "ids": taken}))
    train = {"max_steps": 2, "micro_batch_size": 2, "sequence_len": 128, "learning_rate": 0.001, "warmup_steps": 1}
    train.update(logging_steps=1, save_steps=2, adapter="lora", lora={"r": 4, "alpha": 8, "dropout": 0.0})
    check = {
        "samples": [{"name": "lm", "source": "ladder", "domain": "math", "levels": [1], "size": 6}],
        "judges": {"math": {"kind": "math"}},
        "max_new_tokens": 12,
    }
    cfg = domain_lora.Config(domain="math", train=train, eval_rows=8, gguf=False, check=check, max_train_rows=16)
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    work.mkdir()
    result = domain_lora.run(cfg, {"base": student, "data": stage0, "mined": mined}, out, work)
    manifest = json.loads((out / "adapter.json").read_text())
    assert manifest["check"]["tasks"] == 6 and manifest["ships"] is False and not ships(out)
    assert result.metrics["check/ships"] == 0.0 and "NOT shipped" in result.summary
    checked = {json.loads(line)["id"] for line in (work / "check" / "base" / "rows.jsonl").read_text().splitlines()}
    assert checked and not checked & set(taken)  # none of the tasks 1B mined

    router_out = tmp_path / "router"
    router_out.mkdir()
    rcfg = train_router.Config(domains=["math", "code"], epochs=1)
    train_router.run(rcfg, {"data": stage0, "math": out}, router_out)
    labels = json.loads((router_out / "router.json").read_text())["labels"]
    assert labels == ["base"]  # math does not ship; code's adapter is not wired (its stage did not run)

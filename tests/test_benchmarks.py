"""The benchmarks' one split into a mining and an evaluation half: fixed by task id, disjoint, and
the evaluation half never reaches stage 0's output (train, validation or test)."""

from __future__ import annotations

import json

import pytest
import yaml

from core.paths import REPO_ROOT
from eval.shared_data import SHARED
from methods.benchmarks import load_tasks, part
from methods.failures import row_key
from tests.conftest import needs_shared

FILES = {
    "gsm8k": SHARED / "data" / "gsm8k" / "test.jsonl",
    "mbpp": SHARED / "data" / "mbpp" / "mbpp.jsonl",
    "humaneval": SHARED / "data" / "humaneval" / "HumanEval.jsonl.gz",
}


@pytest.fixture(scope="module")
def tasks() -> dict:
    needs_shared()
    return {name: load_tasks(name, path) for name, path in FILES.items()}


def test_parts_are_disjoint_complete_and_about_half(tasks):
    for name, all_tasks in tasks.items():
        mining = {t.id for t in all_tasks if t.part == "mining"}
        evaluation = {t.id for t in all_tasks if t.part == "evaluation"}
        assert not mining & evaluation and len(mining | evaluation) == len(all_tasks), name
        assert 0.4 < len(evaluation) / len(all_tasks) < 0.6, name
        assert {t.id for t in load_tasks(name, FILES[name], "mining")} == mining
        assert len({t.id for t in all_tasks}) == len(all_tasks), f"{name}: task ids are not unique"


def test_the_part_follows_the_task_id_not_the_file_order(tasks, tmp_path):
    lines = FILES["mbpp"].read_text().splitlines()
    shuffled = tmp_path / "mbpp.jsonl"
    shuffled.write_text("\n".join(reversed(lines)) + "\n")
    again = {t.id: t.part for t in load_tasks("mbpp", shuffled)}
    assert again == {t.id: t.part for t in tasks["mbpp"]}
    assert part("mbpp", "mbpp/11") == part("mbpp", "mbpp/11")


def test_stage0_never_reads_an_evaluation_task(tasks, tmp_path):
    """The tiny recipe's stage 0 on the real sources: MBPP's evaluation half is held out as it is
    read, and no evaluation task of any benchmark is in any split (by instruction and input)."""
    import stages.curate as curate
    from methods.training.chat import load_split

    cfg = curate.Config(**yaml.safe_load((REPO_ROOT / "recipes/stage0/tiny.yaml").read_text()))
    curate.run(cfg, {}, tmp_path)
    stats = json.loads((tmp_path / "stats.json").read_text())
    evaluation = [t for all_tasks in tasks.values() for t in all_tasks if t.part == "evaluation"]
    mbpp_eval = sum(1 for t in tasks["mbpp"] if t.part == "evaluation")
    assert stats["held_out"] == mbpp_eval > 400
    curated = {
        row_key(r["instruction"], r["input"])
        for split in ("train", "validation", "test")
        for r in load_split(tmp_path / "dataset", split)
    }
    assert not {row_key(*t.instruction()) for t in evaluation} & curated
    # The check can see a benchmark row: MBPP's mining half is curated.
    mining_seen = {row_key(*t.instruction()) for t in tasks["mbpp"] if t.part == "mining"} & curated
    assert len(mining_seen) > 300
    assert "benchmark evaluation tasks held out" in (tmp_path / "data_card.md").read_text()


def test_reference_solutions_pass_their_own_judges(tasks):
    """The tasks are built right: each benchmark's gold answer passes its judge (HumanEval's
    canonical bodies include nested functions; MBPP's programs define helpers)."""
    from methods.judges import make_judge

    judges = {"math": make_judge("math"), "code": make_judge("code", wall_seconds=10)}
    for all_tasks in tasks.values():
        for t in all_tasks[:: max(1, len(all_tasks) // 12)]:
            verdict = judges[t.judge](t.task, t.task.reference)
            assert verdict.passed, f"{t.id}: {verdict.reason}"

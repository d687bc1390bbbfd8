"""Stage 2F's candidate rows: the split's first N, or N drawn in turn from each domain."""

from __future__ import annotations

from pathlib import Path

from stages.recovery_lora import Config, _candidates

TRAIN = {"max_steps": 1, "micro_batch_size": 1, "sequence_len": 64, "adapter": "lora", "lora": {"r": 2, "alpha": 4}}


def _split(tmp_path: Path) -> Path:
    from datasets import Dataset, DatasetDict

    domains = ["general"] * 5 + ["math"] * 3 + ["code"] * 1
    rows = [
        {"id": f"r{i}", "source": "t", "domain": d, "instruction": f"q{i}", "input": "", "output": f"a{i}"}
        for i, d in enumerate(domains)
    ]
    DatasetDict({"train": Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dataset"))
    return tmp_path / "dataset"


def test_first_rows_and_rows_by_domain(tmp_path: Path) -> None:
    data = _split(tmp_path)
    first = _candidates(data, Config(train=TRAIN, candidate_rows=4))
    assert [r["domain"] for r in first] == ["general"] * 4
    spread = _candidates(data, Config(train=TRAIN, candidate_rows=7, candidates="by_domain"))
    # round robin in order of first appearance; a domain that runs out drops out of the turn
    assert [r["id"] for r in spread] == ["r0", "r5", "r8", "r1", "r6", "r2", "r7"]
    everything = _candidates(data, Config(train=TRAIN, candidate_rows=50, candidates="by_domain"))
    assert sorted(r["id"] for r in everything) == sorted(f"r{i}" for i in range(9))
    assert len(_candidates(data, Config(train=TRAIN, candidates="by_domain"))) == 9

"""Which stage-0 rows a stage reads: 2F's candidates (the split's first N, or N drawn in turn from
each domain) and the compression stages' validation rows (2A-2F: always drawn in turn from each domain,
since stage 0 stores a split domain after domain)."""

from __future__ import annotations

from pathlib import Path

import pytest

from eval.shared_data import SHARED
from methods.training.chat import load_split
from stages.recovery_lora import Config, _candidates

TRAIN = {"max_steps": 1, "micro_batch_size": 1, "sequence_len": 64, "adapter": "lora", "lora": {"r": 2, "alpha": 4}}


def _split(tmp_path: Path) -> Path:
    from datasets import Dataset, DatasetDict

    domains = ["general"] * 5 + ["math"] * 3 + ["code"] * 1
    rows = [
        {"id": f"r{i}", "source": "t", "domain": d, "instruction": f"q{i}", "input": "", "output": f"a{i}"}
        for i, d in enumerate(domains)
    ]
    DatasetDict({"train": Dataset.from_list(rows), "validation": Dataset.from_list(rows)}).save_to_disk(
        str(tmp_path / "dataset")
    )
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


def test_validation_rows_read_every_domain(tmp_path: Path, monkeypatch) -> None:
    """The perplexity 2A-2D and 2F report is read on rows of every domain (on the small preset's split the
    first 60 were all general: 4-bit AWQ halved the math ladder with every perplexity green); a shorter
    read is a prefix of a longer one (2F checks its decompressed base on the first rows)."""
    data = _split(tmp_path)
    assert [r["id"] for r in load_split(data, "validation", limit=4, by_domain=True)] == ["r0", "r5", "r8", "r1"]
    assert load_split(data, "validation", limit=2, by_domain=True) == load_split(data, "validation", limit=2)[:1] + [
        load_split(data, "validation", domain="math", limit=1)[0]
    ]
    model = SHARED / "models" / "stories260K" / "hf"
    if not model.is_dir():
        pytest.skip(f"needs {model} (../shared)")
    from methods.measure import lm

    read: list[list[str]] = []
    real = lm._response_nll
    monkeypatch.setattr(
        lm, "_response_nll", lambda m, tok, rows, *a: read.append([r["id"] for r in rows]) or real(m, tok, rows, *a)
    )
    scored = lm.validation_rows(model, data, 3, 32)
    assert read == [["r0", "r5", "r8"]] and len(scored) == 3 and all(n > 0 for _, n in scored)

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


def test_loop_rows_are_the_retraining_rounds_own_mix(tmp_path: Path) -> None:
    """`rows: loop` trains on 1D's pairs and exactly the replay rows 1R drew (1R's recipe, read from the
    reference artifact's manifest, through the function 1R itself draws them with); a reference that is
    not a retraining round's artifact, or a graph without the pairs, is refused by name."""
    import json

    from core.contract import KibidangoError
    from methods.failures import loop_mix
    from stages.recovery_lora import _loop_rows

    data = _split(tmp_path)
    pairs = [{"id": f"p{i}", "domain": "math", "instruction": "q", "input": "", "output": "#### 1"} for i in range(3)]
    (tmp_path / "1D").mkdir()
    (tmp_path / "1D" / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    (tmp_path / "1R").mkdir()
    recipe = {"replay_share": 0.5, "pair_repeats": 2, "seed": 3}
    (tmp_path / "1R" / "manifest.json").write_text(json.dumps({"config": recipe}))
    out = tmp_path / "out"
    out.mkdir()
    inputs = {"reference": tmp_path / "1R", "pairs": tmp_path / "1D"}
    rows, metrics = _loop_rows(inputs, data, out)
    pair_rows, replay = loop_mix(pairs, load_split(data, "train"), 0.5, 2, 3)
    assert rows == [*pair_rows, *replay] and len(pair_rows) == 6 and len(replay) == 6
    assert metrics == {"loop_pair_rows": 6.0, "loop_replay_rows": 6.0}
    written = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert [w["source"] for w in written] == ["pair"] * 6 + ["replay"] * 6
    assert [w["id"] for w in written[6:]] == [r["id"] for r in replay]

    (tmp_path / "1R" / "manifest.json").write_text(json.dumps({"config": {"tier": "target"}}))
    with pytest.raises(KibidangoError, match=r"not a retraining round's artifact .*config\.replay_share"):
        _loop_rows(inputs, data, out)
    with pytest.raises(KibidangoError, match="needs the `pairs` input"):
        _loop_rows({"reference": tmp_path / "1R"}, data, out)

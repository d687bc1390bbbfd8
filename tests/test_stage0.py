"""Stage 0 end to end on small files: outputs, card figures, quarantine, determinism, fallback."""

from __future__ import annotations

import json

import datasets
import pytest

from core.contract import KibidangoError
from core.hashing import file_sha256
from stages import load_stage
from tests.conftest import write_jsonl

s0 = load_stage("0")


def _sources(tmp_path):
    alpaca = [
        {
            "instruction": "Give three tips for staying healthy.",
            "input": "",
            "output": "Eat vegetables, sleep eight hours and walk every day.",
        },
        {
            "instruction": "Give three tips for staying healthy.",
            "input": "",
            "output": "Eat vegetables, sleep eight hours and walk every day.",
        },
        {
            "instruction": "Write a Python function that adds two numbers.",
            "input": "",
            "output": "def add(a, b):\n    return a + b",
        },
        {
            "instruction": "Traduisez cette phrase en anglais s'il vous plaît.",
            "input": "",
            "output": "Je voudrais un café et un croissant, merci beaucoup.",
        },
        {"instruction": "Say nothing.", "input": "", "output": ""},
        {"instruction": "Missing its output."},
        {"instruction": "Wrong type", "output": ["a", "list"]},
    ]
    lines = [json.dumps(r) for r in alpaca] + [
        '{"instruction": "half a line',
        json.dumps(
            {
                "instruction": "Explain why the sky is blue in one sentence.",
                "output": "Air scatters blue light more than red light.",
            }
        ),
    ]
    a = tmp_path / "alpaca.jsonl"
    a.write_text("\n".join(lines) + "\n")
    g = write_jsonl(
        tmp_path / "gsm.jsonl",
        [
            {
                "question": "Tom has 3 apples and buys 4 more. How many apples does he have now?",
                "answer": "3 + 4 = 7\n#### 7",
            },
            {"question": "A box holds 12 eggs. How many eggs are in 5 boxes?", "answer": "12 * 5 = 60\n#### 60"},
        ],
    )
    return [
        {"name": "alp", "path": str(a), "format": "alpaca", "license": "CC BY-NC 4.0"},
        {"name": "gsm", "path": str(g), "format": "gsm8k", "domain": "math", "license": "MIT"},
    ]


def test_stage0_outputs_card_and_quarantine(tmp_path):
    cfg = s0.Config(sources=_sources(tmp_path), split={"validation": 0.2, "test": 0.2})
    out = tmp_path / "out"
    out.mkdir()
    result = s0.run(cfg, {}, out)
    m = result.metrics
    assert (m["rows_in"], m["rows_rejected"], m["rows_out"]) == (8, 3, 5)
    assert m["exact_duplicates"] == 1 and m["dropped/empty"] == 1 and m["dropped/language_fr"] == 1

    dd = datasets.load_from_disk(str(out / "dataset"))
    assert sum(len(dd[s]) for s in ("train", "validation", "test")) == 5
    rows = {r["id"]: r for s in dd.values() for r in s}
    assert rows["alp-000003"]["domain"] == "code" and rows["gsm-000001"]["domain"] == "math"

    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert [(r["line"], r["field"]) for r in rejects] == [(6, "output"), (7, "output"), (8, "")]
    assert rejects[2]["reason"].startswith("malformed JSON") and rejects[0]["file"].endswith("alpaca.jsonl")

    card = (out / "data_card.md").read_text()
    assert card.startswith("---\n") and "num_examples" in card
    assert "| alp | " in card and "| 6 | 3 | 3 |" in card  # rows read, rejected, kept for the alpaca file
    assert "| rejected as unreadable (quarantined in `rejects.jsonl`) | 3 |" in card
    assert "| language:fr | 1 |" in card and "Duplicate rate: **16.67%**" in card  # 1 of 6 after filters
    assert (out / "length_histogram.png").stat().st_size > 1000
    stats = json.loads((out / "stats.json").read_text())
    assert stats["splits"] == {k: len(v) for k, v in dd.items()}


def test_stage0_output_is_byte_identical_across_runs(tmp_path):
    cfg = s0.Config(sources=_sources(tmp_path))
    digests = []
    for name in ("a", "b"):
        out = tmp_path / name
        out.mkdir()
        s0.run(cfg, {}, out)
        digests.append({p.relative_to(out).as_posix(): file_sha256(p) for p in sorted(out.rglob("*")) if p.is_file()})
    assert digests[0] == digests[1]


def test_split_is_stable_when_rows_are_added():
    rows = [s0.Example(f"r-{i}", "s", "general", "i", "", "o") for i in range(200)]
    cfg = s0.SplitConfig(validation=0.1, test=0.1)
    before = {ex.id: name for name, part in s0._split(rows, cfg).items() for ex in part}
    more = rows + [s0.Example(f"new-{i}", "s", "general", "i", "", "o") for i in range(50)]
    after = {ex.id: name for name, part in s0._split(more, cfg).items() for ex in part}
    assert all(after[k] == v for k, v in before.items())
    assert 0 < list(before.values()).count("test") < 40


def test_synthetic_fallback_when_no_source_is_present(tmp_path):
    absent = [
        {"name": "gone", "path": str(tmp_path / "missing.json"), "format": "alpaca", "license": "MIT", "optional": True}
    ]
    out = tmp_path / "out"
    out.mkdir()
    result = s0.run(s0.Config(sources=absent, synthetic_rows=300), {}, out)
    assert result.metrics["rows_in"] == 300 and result.metrics["near_duplicates"] >= 10
    assert {"domain/general", "domain/math", "domain/code"} <= result.metrics.keys()
    card = (out / "data_card.md").read_text()
    assert "| gone |" in card and "| absent |" in card and "| synthetic |" in card
    # announced loudly: summary, metric and card
    assert result.summary.startswith("SYNTHETIC DATA") and result.metrics["synthetic"] == 1.0
    assert "**SYNTHETIC DATA.**" in card
    out2 = tmp_path / "out2"
    out2.mkdir()
    with pytest.raises(KibidangoError, match="no source is present and synthetic_rows is 0"):
        s0.run(s0.Config(sources=absent), {}, out2)


def test_an_absent_optional_source_beside_a_present_one_is_named_in_the_summary(tmp_path):
    present = tmp_path / "rows.json"
    rows = [{"instruction": f"Say {i}.", "input": "", "output": f"{i} " * 8} for i in range(40)]
    present.write_text(json.dumps(rows))
    sources = [
        {"name": "here", "path": str(present), "format": "alpaca", "license": "MIT"},
        {"name": "gone", "path": str(tmp_path / "gone.json"), "format": "alpaca", "license": "MIT", "optional": True},
    ]
    out = tmp_path / "out"
    out.mkdir()
    result = s0.run(s0.Config(sources=sources), {}, out)
    assert result.summary.startswith("SOURCES ABSENT, skipped as optional (gone): ")
    assert result.metrics["sources_absent"] == 1 and result.metrics["synthetic"] == 0.0


def test_a_present_source_with_no_valid_rows_is_an_error_not_a_synthetic_fallback(tmp_path):
    """The probe: a JSON array read as JSONL (27 rejects) was replaced by 2,000 generated rows."""
    broken = write_jsonl(tmp_path / "broken.jsonl", [{"question": "wrong format"}] * 27)
    sources = [{"name": "mine", "path": str(broken), "format": "alpaca", "license": "MIT", "optional": True}]
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(
        KibidangoError,
        match=r"source 'mine': .*broken.jsonl yielded no valid rows \(27 quarantined; first: .*:1: field "
        r"'instruction' missing",
    ):
        s0.run(s0.Config(sources=sources, synthetic_rows=2000), {}, out)


def test_external_inputs_change_with_source_bytes(tmp_path):
    cfg = s0.Config(sources=_sources(tmp_path))
    before = s0.external_inputs(cfg)
    path = cfg.sources[1].path
    with open(path, "a") as f:
        f.write(json.dumps({"question": "1 + 1?", "answer": "#### 2"}) + "\n")
    after = s0.external_inputs(cfg)
    assert after["source:alp"] == before["source:alp"] and after["source:gsm"] != before["source:gsm"]

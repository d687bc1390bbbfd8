"""The benchmark: the Leviathan model, prompt files, and a small run that prints every row."""

from __future__ import annotations

import pytest

from kibidango import write_bundle
from kibidango.bench import format_table, leviathan_speedup, read_prompts, run_bench
from tests.conftest import STORIES, needs_stories


def test_leviathan_speedup_formula():
    assert leviathan_speedup(0.0, 4, 0.1) == pytest.approx(1 / 1.4)  # nothing accepted: pure overhead
    assert leviathan_speedup(1.0, 4, 0.0) == pytest.approx(5.0)  # free draft, all accepted: k + 1
    assert leviathan_speedup(0.8, 4, 0.05) == pytest.approx((1 - 0.8**5) / (0.2 * 1.2))
    assert leviathan_speedup(0.8, 4, 1.0) < 1  # a draft as slow as the target never pays


def test_prompt_files(tmp_path):
    (tmp_path / "p.txt").write_text("Once upon a time\n\nThe cat\n")
    assert read_prompts(tmp_path / "p.txt") == ["Once upon a time", "The cat"]
    (tmp_path / "p.jsonl").write_text('{"prompt": "A"}\n{"text": "B"}\n')
    with pytest.raises(ValueError, match=r"p\.jsonl:2: expected a JSON object with a 'prompt' string"):
        read_prompts(tmp_path / "p.jsonl")


def test_bench_runs_every_mode_and_the_hf_peer(tmp_path):
    needs_stories()
    tiers = {t: {"hf": STORIES, "vocab_size": 512} for t in ("draft", "qualifier", "target")}
    bundle = write_bundle(tmp_path / "b", tiers, {"mode": "pyramid"})
    result = run_bench(bundle, ["Once upon a time"], ["ar", "sd", "pyramid", "pyramid-exact"], max_new_tokens=12)
    modes = [r["mode"] for r in result.rows]
    assert modes == ["ar", "sd", "pyramid-fuzzy", "pyramid-exact", "HF generate(assistant_model=draft)"]
    assert all(r["tokens"] == 12 for r in result.rows)
    sd = result.rows[1]
    assert sd["acceptance"]["draft"] == 1.0 and sd["target_forwards_per_token"] == pytest.approx(
        3 / 12
    )  # identical tiers
    table = format_table(result)
    assert "Leviathan model predicts" in table and "cost of one forward step" in table
    assert result.verify_cost > 0 and "5-token verification costs" in table  # k = 4 (the default)
    b = result.bandwidth  # ar against the bound (stories260K's 1 MB of weights may sit in the CPU cache)
    assert b["target_weight_bytes"] == 4 * 260_032 and b["share"] > 0 and "memory-bandwidth bound" in table

"""The benchmark: the Leviathan model, prompt files, and a small run that prints every row."""

from __future__ import annotations

import pytest

from kibidango import write_bundle
from kibidango.tools.bench import format_table, leviathan_speedup, read_prompts, run_bench
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


def test_bootstrap_ratio_is_paired_over_cells():
    from kibidango.tools.bench import bootstrap_ratio

    # b twice as fast as a in every cell, whatever the cell's own speed: the interval is the point
    a = [(10, s) for s in (1.0, 2.0, 4.0, 0.5)]
    b = [(10, s / 2) for s in (1.0, 2.0, 4.0, 0.5)]
    point, lo, hi = bootstrap_ratio(a, b)
    assert point == pytest.approx(0.5) and lo == pytest.approx(0.5) and hi == pytest.approx(0.5)
    noisy = [(10, s * f) for s, f in zip((1.0, 2.0, 4.0, 0.5), (1.3, 0.8, 1.1, 0.9), strict=True)]
    point, lo, hi = bootstrap_ratio(noisy, b)
    assert lo < point < hi


def test_a_mode_with_the_table_is_compared_with_itself_without_it():
    from kibidango.tools.bench import _table_vs_without

    slow = [(10, s) for s in (1.0, 2.0, 4.0, 0.5)]
    fast = [(10, s / 2) for s in (1.0, 2.0, 4.0, 0.5)]
    cells = {"ar": slow, "lookup+k12+nm2": slow, "lookup+k12+nm2+table+tk8": fast, "sd+table": fast}
    (note,) = _table_vs_without(cells, 4, 1)  # sd+table has no control among the modes
    assert note.startswith("lookup+k12+nm2+table+tk8 / lookup+k12+nm2 (the n-gram table's contribution): 2.00x")


def test_repeats_give_every_ratio_an_interval_and_settle_pyramid_against_sd(tmp_path):
    needs_stories()
    tiers = {t: {"hf": STORIES, "vocab_size": 512} for t in ("draft", "qualifier", "target")}
    bundle = write_bundle(tmp_path / "b", tiers, {"mode": "pyramid"})
    prompts = ["Once upon a time", "The cat"]
    modes = ["ar", "sd", "lookup", "pyramid-exact"]
    seen: list[tuple[int, int]] = []
    result = run_bench(
        bundle, prompts, modes, max_new_tokens=8, repeats=2, peers=(), progress=lambda n, t: seen.append((n, t))
    )
    assert seen == [(1, 4), (2, 4), (3, 4), (4, 4)]  # after each prompt of each round
    for row in result.rows:
        lo, hi = row["speed_interval"]
        assert lo <= row["speed_vs_ar"] <= hi
    assert result.rows[0]["speed_interval"] == (pytest.approx(1.0), pytest.approx(1.0))  # ar against itself
    (note,) = [n for n in result.notes if n.startswith("best pyramid")]
    assert "(95% bootstrap over 2 prompts x 2 rounds)" in note and "best sd (" in note
    assert "[" in format_table(result).splitlines()[3]


def test_a_mode_may_carry_its_own_settings_so_one_run_compares_them():
    from kibidango.tools.bench import parse_mode

    assert parse_mode("sd") == ("sd", None, {})
    assert parse_mode("sd+adaptive+lookup+kmax8") == ("sd", None, {"adaptive": True, "lookup": True, "k_max": 8})
    assert parse_mode("sd+k6+p0.3") == ("sd", None, {"k": 6, "p_min": 0.3})
    assert parse_mode("pyramid-exact+lD3+lQ6") == ("pyramid", "exact", {"l_D": 3, "l_Q": 6})
    assert parse_mode("sd+t1+tb2") == ("sd", None, {"threads": 1, "threads_batch": 2})
    assert parse_mode("lookup+k12+nm2+table+tk8") == (
        "lookup",
        None,
        {"k": 12, "ngram_min": 2, "ngram_table": True, "table_k": 8},
    )
    for bad, why in [
        ("sdx", "unknown mode 'sdx'"),
        ("sd+fast", "unknown setting 'fast'"),
        ("sd+pX", "unknown"),
        ("sd+table2", "unknown setting 'table2'"),
        ("ar+t0", "at least 1 thread"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_mode(bad)


def test_settings_of_one_mode_are_benchmarked_side_by_side(tmp_path):
    needs_stories()
    tiers = {t: {"hf": STORIES, "vocab_size": 512} for t in ("draft", "qualifier", "target")}
    bundle = write_bundle(tmp_path / "b", tiers, {"mode": "pyramid"})
    modes = ["ar", "sd", "sd+k2", "sd+adaptive+lookup", "pyramid+lD2"]
    result = run_bench(bundle, ["Once upon a time", "The cat"], modes, max_new_tokens=9, repeats=2, peers=())
    rows = {r["mode"]: r for r in result.rows}
    assert list(rows) == ["ar", "sd", "sd+k2", "sd+adaptive+lookup", "pyramid-fuzzy+lD2"]
    # identical tiers: every draft token is accepted, so k sets the target's passes per token
    assert rows["sd"]["target_forwards_per_token"] < rows["sd+k2"]["target_forwards_per_token"]
    assert rows["sd+k2"]["mean_acceptance_length"] == pytest.approx(3.0)  # 9 tokens: 3 rounds of 2 + 1
    (note,) = [n for n in result.notes if n.startswith("best pyramid")]
    assert "best sd (sd" in note  # the fastest of the sd settings, whichever it was

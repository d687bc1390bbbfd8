"""``kibidango tune`` (1F): the search runs every candidate against ar, keeps lossless modes
exact and lossy ones under the perplexity constraint, and the chosen settings written into a
bundle are what a plain load of that bundle on that backend decodes with."""

from __future__ import annotations

import json

import pytest

from kibidango import Pipeline, write_bundle
from kibidango.tools.tune import candidates, choose, format_tune, tune, write_tuned
from tests.conftest import STORIES, needs_stories

GRID = {"k": (2, 4), "lengths": ((2, 4),), "taus": ((0.3, 0.2),), "p_min": (), "lookup_k": ()}


def test_the_grid_covers_every_mode_and_variant():
    modes = {(c["mode"], c.get("variant")) for c in candidates()}
    assert modes == {
        ("sd", None),
        ("lookup", None),
        ("pyramid", "exact"),
        ("pyramid", "fuzzy"),
        ("pyramid", "assisted"),
    }
    # sd: each k, adaptive from the shortest; pyramid exact: the pair, adaptive; fuzzy, assisted
    assert len(candidates(GRID)) == 2 + 1 + 1 + 1 + 2
    full = candidates({**GRID, "p_min": (0.5,), "lookup_k": (3,), "k_max": 9})
    assert {"mode": "sd", "k": 4, "p_min": 0.5} in full and {"mode": "lookup", "k": 3} in full
    assert {"mode": "sd", "k": 2, "adaptive": True, "k_max": 9, "p_min": 0.5} in full
    assert {"mode": "lookup", "k": 3, "adaptive": True, "k_max": 9} in full
    assert {"mode": "pyramid", "variant": "exact", "l_D": 2, "l_Q": 4, "p_min": 0.5} in full
    assert {"mode": "sd", "k": 4, "lookup": True} in full
    assert {"mode": "pyramid", "variant": "exact", "l_D": 2, "l_Q": 4, "lookup": True} in full
    assert not any(c.get("ngram_table") for c in full)  # a bundle without an n-gram table
    tabled = candidates({**GRID, "lookup_k": (3,)}, table=True)
    assert {"mode": "lookup", "k": 3, "ngram_table": True} in tabled
    assert {"mode": "sd", "k": 4, "lookup": True, "ngram_table": True} in tabled
    assert len(tabled) == len(candidates({**GRID, "lookup_k": (3,)})) + 2


def test_a_mode_on_more_tiers_must_pay_for_them():
    """The defaults' mode: ar unless a row beats 1.0x; a mode on more tiers (sd: a draft, pyramid: a
    draft and a qualifier) replaces one on fewer only when faster by more than the tier gain."""
    lookup = {"mode": "lookup", "k": 3, "speed_vs_ar": 1.06}
    sd = {"mode": "sd", "k": 2, "speed_vs_ar": 1.12}
    pyramid = {"mode": "pyramid", "variant": "exact", "l_D": 2, "l_Q": 4, "speed_vs_ar": 1.30}
    assert choose([lookup, sd, pyramid]) is pyramid  # no gain asked: the fastest
    assert choose([lookup, sd], 0.05) is sd  # 1.12 > 1.06 * 1.05
    assert choose([lookup, {**sd, "speed_vs_ar": 1.08}], 0.05) is lookup  # not faster by more than 5%
    assert choose([{**sd, "speed_vs_ar": 1.04}], 0.05)["mode"] == "ar"  # the draft does not pay against ar
    assert choose([{**sd, "speed_vs_ar": 1.06}], 0.05)["mode"] == "sd"
    assert choose([{**lookup, "speed_vs_ar": 0.97}])["mode"] == "ar"  # nothing beats the target alone
    # the pyramid measured against the choice so far (sd), not only against the mode on fewest tiers
    assert choose([lookup, sd, {**pyramid, "speed_vs_ar": 1.17}], 0.05) is sd
    assert choose([lookup, sd, {**pyramid, "speed_vs_ar": 1.18}], 0.05)["mode"] == "pyramid"


def test_tuned_defaults_are_written_and_read_per_backend(tmp_path):
    needs_stories()
    tiers = {t: {"hf": STORIES, "vocab_size": 512} for t in ("draft", "qualifier", "target")}
    bundle = write_bundle(tmp_path / "b", tiers, {"mode": "sd", "k": 4})
    pipe = Pipeline.from_bundle(bundle, mode="pyramid", adapter="none")
    result = tune(pipe, ["Once upon a time", "The cat"], max_new_tokens=12, grid=GRID)
    assert len(result.rows) == 7
    for row in result.rows:  # identical tiers: every candidate reproduces ar
        assert row["agreement_with_ar"] == 1.0 and row["admissible"] and "note" not in row
        assert row["ppl_increase"] == pytest.approx(0.0, abs=1e-9)
    assert result.chosen is not None and set(result.best) == {"sd", "pyramid"}
    assert "best pyramid / best sd" in format_tune(result)

    chosen = {"mode": "pyramid", "variant": "assisted", "l_D": 2, "l_Q": 4, "tau_Q": 0.3, "tau_T": 0.2}
    tuned = write_tuned(bundle, tmp_path / "tuned", "torch", chosen, {"best": result.best})
    d = Pipeline.from_bundle(tuned).defaults
    assert (d.mode, d.variant, d.l_D, d.l_Q, d.tau_Q, d.tau_T) == ("pyramid", "assisted", 2, 4, 0.3, 0.2)
    meta = json.loads((tuned / "bundle.json").read_text())
    assert meta["runtime_defaults"] == {"mode": "sd", "k": 4}  # the plain defaults stay for other backends
    assert meta["tuning"]["torch"]["best"]["sd"]["mode"] == "sd"
    # another backend's tuning leaves torch's alone
    both = write_tuned(tuned, tmp_path / "both", "llamacpp", {"mode": "sd", "k": 6}, {})
    assert Pipeline.from_bundle(both).defaults.variant == "assisted"
    assert json.loads((both / "bundle.json").read_text())["tuned_defaults"]["llamacpp"] == {"mode": "sd", "k": 6}
    assert Pipeline.from_bundle(bundle).defaults.mode == "sd"  # the source bundle is untouched


def test_a_lossless_mismatch_is_told_apart_from_a_near_tie(tmp_path):
    """Where a candidate first leaves ar's tokens, the gap between the target's logits for the two
    tokens: a near-tie (rounding of a batched step) or a real disagreement (a bug)."""
    import numpy as np

    from kibidango.tools.tune import NEAR_TIE, divergence_gap

    needs_stories()
    tiers = {"target": {"hf": STORIES, "vocab_size": 512}}
    target = Pipeline.from_bundle(write_bundle(tmp_path / "b", tiers, {"mode": "ar"}), adapter="none").models["target"]
    prompt = [1, *target.new_session().feed([1])[-1].argsort()[-3:].tolist()]
    ar, session = [], target.new_session()
    logits = session.feed(prompt)[-1]
    for _ in range(8):
        ar.append(int(np.argmax(logits)))
        logits = session.feed([ar[-1]])[-1]
    assert divergence_gap(target, prompt, ar, list(ar)) is None
    session = target.new_session()
    row = session.feed(prompt)[-1]
    for token in ar[:3]:
        row = session.feed([token])[-1]
    runner_up = int(np.argsort(row)[-2])
    gap = divergence_gap(target, prompt, ar, [*ar[:3], runner_up, *ar[4:]])
    assert gap == pytest.approx(float(row[ar[3]] - row[runner_up]), abs=1e-5) and gap >= 0  # ar's own arithmetic
    worst = int(np.argmin(row))
    assert divergence_gap(target, prompt, ar, [*ar[:3], worst]) > NEAR_TIE  # far from a tie: a bug

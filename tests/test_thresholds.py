"""Stage 6C's sweep and choice, and stage 6B's detector, on synthetic judged answers whose right
answer is known."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kibidango.addons.confidence import ANSWER_FEATURES, Calibrator, EscalationDetector
from stages import escalation, thresholds


def _cfg(**kw) -> thresholds.Config:
    cloud = {"name": "c", "usd_per_1k_prompt": 1.0, "usd_per_1k_completion": 2.0, "validation_prompt_tokens": 0}
    return thresholds.Config(cloud=cloud, **kw)


def _query(local_pass: bool, conf: float, adapter_pass: bool | None = None, route: float = 0.0) -> dict:
    base = {"pass": local_pass, "confidence": conf, "flag": False, "tokens": 10}
    adapter = base if adapter_pass is None else {**base, "pass": adapter_pass}
    return {
        "route_confidence": route,
        "cloud_pass": True,
        "query_tokens": 100,
        "reference_tokens": 50,
        "base": base,
        "adapter": adapter,
    }


def test_a_confidence_that_separates_passes_reaches_cloud_quality_escalating_only_the_failures():
    # 7 passing answers the model is sure of, 3 failing ones it is not: one threshold in between
    queries = [_query(True, 0.9)] * 7 + [_query(False, 0.2)] * 3
    results = thresholds.sweep(queries, _cfg())
    chosen = thresholds.choose(results, 0.3)
    assert chosen["quality"] == pytest.approx(1.0) and chosen["escalated"] == pytest.approx(0.3)
    local_only = thresholds.choose(results, 0.0)
    assert local_only["quality"] == pytest.approx(0.7) and local_only["usd_per_1k_queries"] == 0
    # cloud answers cost (100 * $1 + 50 * $2) / 1K tokens = $0.2 each; validation of a failing
    # answer costs the prompt (100 + 10 tokens) and verdict + correction (8 + 50): $0.226
    everything = [x for x in results if x["cloud"] == 1.0][0]
    assert everything["usd_per_1k_queries"] == pytest.approx(200.0)
    assert chosen["cloud"] == pytest.approx(0.3) and chosen["usd_per_1k_queries"] == pytest.approx(60.0)  # cheaper
    validated = [x for x in results if x["validated"] == pytest.approx(0.3) and x["quality"] == pytest.approx(1.0)]
    assert validated and validated[0]["usd_per_1k_queries"] == pytest.approx(3 * 0.226 / 10 * 1000)
    front = thresholds.pareto(results)
    assert [x["escalated"] for x in front] == sorted(x["escalated"] for x in front)
    assert all(b["quality"] > a["quality"] for a, b in zip(front, front[1:]))


def test_the_router_threshold_picks_the_adapter_only_where_it_helps():
    # the adapter fixes the confidently routed queries and breaks the unsure ones
    queries = [_query(False, 0.5, adapter_pass=True, route=0.95)] * 5 + [_query(True, 0.5, False, route=0.55)] * 5
    chosen = thresholds.choose(thresholds.sweep(queries, _cfg()), 0.0)
    assert chosen["quality"] == pytest.approx(1.0) and 0.55 < chosen["router"] <= 0.95


def test_no_combination_within_the_objective_is_a_clear_error():
    with pytest.raises(Exception, match="escalates at most"):
        thresholds.choose([{"escalated": 0.5, "quality": 1.0, "usd_per_1k_queries": 1.0}], 0.1)


def _rows(n: int, rng) -> list[dict]:
    rows = []
    for i in range(n):
        code = i % 2 == 0
        passed = (not code) and rng.random() < 0.8  # code answers always fail; prose mostly passes
        feats = dict.fromkeys(ANSWER_FEATURES, -1.0)
        answer = {"features": feats, "passed": passed, "outcome": "passed" if passed else "failed", "tokens": 5}
        query = "def f(x): return x + 1  # python code" if code else "Tell me a story about a dog"
        rows.append(
            {
                "query": f"{query} {i}",
                "split": "fit" if i < n // 2 else "eval",
                "domain": "d",
                "base": answer,
                "adapter": None,
            }
        )
    return rows


def test_the_detector_learns_what_the_query_says_about_failure(tmp_path):
    rng = np.random.default_rng(0)
    cal = tmp_path / "cal"
    cal.mkdir()
    (cal / "calibration.json").write_text(json.dumps(Calibrator({"torch": 1.0}, None).to_dict()))
    with open(cal / "answers.jsonl", "w") as f:
        for r in _rows(200, rng):
            f.write(json.dumps(r) + "\n")
    out = tmp_path / "out"
    out.mkdir()
    result = escalation.run(escalation.Config(recall=0.9), {"calibration": cal}, out)
    assert result.metrics["auroc"] > 0.8 > result.metrics["auroc_confidence_only"]  # confidence is constant here
    detector = EscalationDetector.load(out / "escalation.json")
    assert detector.p_fail("def g(y): return y * 2  # python code", 0.3) > detector.p_fail(
        "Tell me a story about a cat", 0.3
    )
    # the threshold is chosen on the fitting half (recall 90% there); held out, recall is near it
    assert result.metrics["eval_recall_at_threshold"] >= 0.7
    # it beats confidence alone by a paired bootstrap: it earns its place (6C may use it, X ships it)
    assert result.metrics["earns_its_place"] == 1.0 and "earns its place" in (out / "ESCALATION_CARD.md").read_text()
    # its penalty on the query features was cross-validated on the fitting half; the card shows the curve
    report = json.loads((out / "escalation_eval.json").read_text())
    assert report["l2"] in escalation.Config().l2 and len(report["l2_cv_log_loss"]) == len(escalation.Config().l2)
    assert f"L2 penalty on the query features: **{report['l2']:g}**" in (out / "ESCALATION_CARD.md").read_text()


def test_the_penalty_comparison_reads_a_2g_artifact(tmp_path, capsys):
    """`python -m eval.escalation_penalty`: both rules on the same 2G answers, whole and subsampled."""
    from eval.escalation_penalty import main

    rng = np.random.default_rng(0)
    cal = tmp_path / "cal"
    cal.mkdir()
    (cal / "calibration.json").write_text(json.dumps(Calibrator({"torch": 1.0}, None).to_dict()))
    (cal / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(200, rng)))
    main([str(cal), "--sizes", "40", "--draws", "2"])
    out = capsys.readouterr().out
    assert "100 fitting answers, 100 evaluation answers" in out
    rows = [line for line in out.splitlines() if line.startswith("| 100 |") or line.startswith("| 40 |")]
    assert len(rows) == 3 and all(float(r.split("|")[5]) > 0.8 for r in rows)  # the query says it: both see it


def test_a_detector_no_better_than_confidence_is_never_switched_on_nor_shipped(tmp_path):
    """Queries that say nothing about failure: the detector's AUROC does not beat confidence alone
    by a paired bootstrap, so 6B says so, 6C sweeps only with it off, and X would ship none."""
    from methods.calibration import paired_auroc_difference
    from stages.export_bundle import _earns_its_place

    rng = np.random.default_rng(1)
    y = rng.random(400) < 0.5
    noise = paired_auroc_difference(rng.random(400), rng.random(400), y)
    assert noise["ci"][0] < 0 < noise["ci"][1]
    sharp = paired_auroc_difference(y + 0.1 * rng.random(400), rng.random(400), y)
    assert sharp["difference"] > 0.4 and sharp["ci"][0] > 0
    assert paired_auroc_difference([0.1, 0.2], [0.3, 0.4], [True, True])["difference"] is None

    cal = tmp_path / "cal"
    cal.mkdir()
    (cal / "calibration.json").write_text(json.dumps(Calibrator({"torch": 1.0}, None).to_dict()))
    with open(cal / "answers.jsonl", "w") as f:
        for i in range(200):
            passed = bool(rng.random() < 0.5)  # nothing in the query says which
            answer = {"features": dict.fromkeys(ANSWER_FEATURES, -1.0), "passed": passed, "tokens": 5}
            answer["outcome"] = "passed" if passed else "failed"
            row = {"query": f"question number {i}", "split": "fit" if i < 100 else "eval", "domain": "d"}
            f.write(json.dumps({**row, "base": answer, "adapter": None}) + "\n")
    out = tmp_path / "out"
    out.mkdir()
    result = escalation.run(escalation.Config(recall=0.9), {"calibration": cal}, out)
    assert result.metrics["earns_its_place"] == 0.0 and "does **not** beat" in (out / "ESCALATION_CARD.md").read_text()
    assert not _earns_its_place(out / "escalation.json")
    queries = [_query(True, 0.9)] * 7 + [_query(False, 0.2)] * 3
    assert {x["detector"] for x in thresholds.sweep(queries, _cfg(), detector=False)} == {False}


def test_the_margin_keeps_the_escalated_share_under_the_cap_on_fresh_queries():
    """Thresholds chosen on 200 queries, the escalated share measured on 4,000 fresh ones from the
    same distribution: chosen at the in-sample cap, the share passes the cap on fresh queries about
    half the time; with the Wilson margin, (almost) never."""

    def draw(rng, n: int) -> list[dict]:
        conf = rng.beta(2, 2, n)  # a smooth spread of confidences; failing more often when unsure
        return [_query(bool(rng.random() < c), float(c)) for c in conf]

    cfg = _cfg(router_thresholds=[0.0], confidence_grid=41)
    over = {False: 0, True: 0}
    for seed in range(12):
        rng = np.random.default_rng(seed)
        sample, fresh = draw(rng, 200), draw(rng, 4000)
        fresh_conf = np.array([q["base"]["confidence"] for q in fresh])
        results = thresholds.sweep(sample, cfg)
        for margin in (False, True):
            x = thresholds.choose(results, 0.2, len(sample) if margin else None)
            # the share of fresh queries below the chosen qualifier threshold (validated or sent to the cloud)
            over[margin] += float((fresh_conf < x["qualifier"]).mean()) > 0.2
    assert over[False] >= 3 and over[True] <= 1, over


def test_eval_cascade_compares_its_escalations_with_6cs_prediction_and_with_random_ones():
    from eval.cascade_eval import against_prediction

    # 10 fresh queries: the local model passes 6; the cascade escalates exactly 2 of the 4 it fails,
    # and the cloud passes every query
    records = []
    for i in range(10):
        local = i < 6
        tier = "cloud" if i in (6, 7) else "local"
        records.append({"tier": tier, "passed": {"local": local, "cloud": True, "cascade": local or tier == "cloud"}})
    a = against_prediction(records, expected=0.2)
    assert a["escalated"] == pytest.approx(0.2) and a["within_5_points"] is True
    assert a["cascade_quality"] == pytest.approx(0.8)
    assert a["random_quality"] == pytest.approx(0.8 * 0.6 + 0.2 * 1.0)  # 0.68
    assert a["difference"] == pytest.approx(0.12) and a["difference_ci"][0] <= 0.12 <= a["difference_ci"][1]
    assert against_prediction(records, expected=0.3)["within_5_points"] is False
    assert against_prediction(records, expected=None)["within_5_points"] is None


def test_apgr_is_the_share_of_the_gap_recovered_averaged_over_escalation_shares():
    """RouteLLM's APGR by hand on 4 queries: local passes the first two, the cloud all four. Escalating
    in the order 3, 2 (the failures first) recovers the gap at half the queries; random is 0.5."""
    from eval.cascade_eval import _apgr, apgr

    local, cloud = [1, 1, 0, 0], [1, 1, 1, 1]
    best = apgr(local, cloud, [0.1, 0.2, 0.9, 0.8], rounds=200)
    # PGR after escalating k = 0..4 queries: 0, 0.5, 1, 1, 1; trapezoid over shares 0..1 in steps of 1/4
    assert best["apgr"] == pytest.approx((0 + 0.5) / 2 / 4 + (0.5 + 1) / 2 / 4 + 1 / 4 + 1 / 4)  # 0.75
    assert best["share_for_90"] == 0.5 and best["random_share_for_90"] == pytest.approx(0.8)
    worst = apgr(local, cloud, [0.9, 0.8, 0.1, 0.2], rounds=200)  # the passes escalated first
    assert worst["apgr"] == pytest.approx(0.25) and worst["apgr"] < 0.5 < best["apgr"]  # PGR 0, 0, 0, 0.5, 1
    assert 0 <= best["apgr_ci"][0] <= best["apgr_ci"][1] <= 1 and "0.750 [" in _apgr(best)
    # the oracle escalates the failures first: here the cascade's own order, so the best any router reaches
    assert best["apgr_oracle"] == worst["apgr_oracle"] == pytest.approx(0.75) and "oracle's" in _apgr(best)
    # a cloud that fails one query too; the cascade escalates 0, 2, 4, 3, 1: PGR 0, 0, 0, 0.5, 0.5, 1
    some = apgr([1, 0, 0, 1, 0], [1, 1, 0, 1, 1], [0.9, 0.1, 0.5, 0.2, 0.3], rounds=50)
    assert some["apgr"] == pytest.approx(0.05 + 0.1 + 0.15)
    assert some["apgr_oracle"] == pytest.approx(0.05 + 0.15 + 0.6)  # 1 and 4 first: PGR 0, 0.5, 1, 1, 1, 1
    assert apgr([1, 0], [1, 0], [0.5, 0.5])["apgr"] is None  # no gap: nothing to recover


def test_eval_cascade_measures_confidence_and_detector_on_its_fresh_answers():
    from eval.cascade_eval import _detection, detection

    def rec(conf, p_fail, passed):
        return {"confidence": conf, "p_fail": p_fail, "passed": {"local": passed}}

    records = [
        rec(0.9, 0.1, True),
        rec(0.8, 0.3, True),
        rec(0.2, 0.7, False),
        rec(0.6, 0.2, False),
        rec(None, None, False),
    ]
    d = detection(records)
    assert d["answers"] == 4 and d["passing"] == 2 and d["detector_answers"] == 4
    assert d["confidence_auroc"] == 1.0  # every pass above every failure
    assert d["detector_auroc"] == 0.75  # one (failure, pass) pair of four out of order
    assert "0.750" in _detection(d)
    assert "not measured" in _detection(detection([rec(0.5, None, True), rec(0.4, None, False)]))

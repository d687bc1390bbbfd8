"""Calibration measures and fits on synthetic data where the answer is known."""

from __future__ import annotations

import numpy as np
import pytest

from kibidango.addons.confidence import Logistic
from methods.calibration import (
    auroc,
    brier,
    choose_l2,
    ece,
    fit_logistic,
    fit_temperature,
    precision_at_recall,
    reliability_plot,
    token_confidence,
)


def _overconfident(n: int = 4000, v: int = 20, sharpen: float = 3.0, seed: int = 0):
    """Labels drawn from softmax(z); the model reports softmax(sharpen * z): over-confident by a
    known factor, so the best temperature is ``sharpen``."""
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(n, v))
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    labels = np.array([rng.choice(v, p=row) for row in p])
    return sharpen * z, labels


def test_temperature_scaling_recovers_the_known_temperature_and_lowers_ece():
    logits, labels = _overconfident()
    fit, held = slice(0, 2000), slice(2000, None)
    t = fit_temperature(logits[fit], labels[fit])
    assert t == pytest.approx(3.0, rel=0.15)
    before, after = token_confidence(logits[held], labels[held]), token_confidence(logits[held], labels[held], t)
    assert ece(after["confidence"], after["correct"]) < ece(before["confidence"], before["correct"]) / 2
    assert after["nll"].mean() < before["nll"].mean()


def test_ece_binning_schemes_and_edge_cases():
    conf = np.array([0.9] * 10)
    hit = np.array([1] * 9 + [0])
    assert ece(conf, hit, bins=1) == pytest.approx(0.0) and ece(conf, hit, scheme="equal_width") == pytest.approx(0.0)
    assert ece(conf, hit) == pytest.approx(0.0)  # tied confidences share one bin, whatever the rows' order
    spread = np.linspace(0.05, 0.95, 30)
    assert ece(spread, spread > 0.5) == pytest.approx(ece(spread[::-1], (spread > 0.5)[::-1]))
    assert ece(spread, np.ones(30), bins=15) == pytest.approx(1 - spread.mean())  # 15 bins of 2: all under
    assert ece(np.array([1.0, 1.0]), np.array([0, 0])) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        ece(conf, hit, scheme="nope")


def test_platt_scaling_learns_a_monotone_map_and_the_scores():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3000, 2))
    y = (rng.random(3000) < 1 / (1 + np.exp(-(2 * x[:, 0] - 0.5)))).astype(float)  # feature 1 is noise
    model = fit_logistic(x[:2000], y[:2000], ["signal", "noise"])
    p = model.predict(x[2000:])
    assert abs(model.weights[0]) > 5 * abs(model.weights[1])
    assert auroc(p, y[2000:]) > 0.8 and brier(p, y[2000:]) < brier(np.full(1000, y[:2000].mean()), y[2000:])
    assert ece(p, y[2000:]) < 0.06
    again = Logistic.from_dict(model.to_dict(), "round trip")
    assert again.predict(x[:3]).tolist() == model.predict(x[:3]).tolist()


def test_the_penalty_is_cross_validated_and_spares_the_free_feature():
    """6B's case: one informative free feature (the confidence) beside many side features (query
    n-grams). When the side features are noise, cross-validation picks a large penalty and the fit
    ranks as the free feature does, where a small fixed penalty fits the noise; when they carry the
    signal, a small penalty wins and beats the free feature alone."""
    rng = np.random.default_rng(3)
    n, side = 400, 60
    free = rng.normal(size=n)
    noise = rng.normal(size=(n, side))
    y = (rng.random(n) < 1 / (1 + np.exp(-1.5 * free))).astype(float)
    x = np.column_stack([noise, free])
    fit, held = slice(0, 120), slice(120, None)
    names = [f"x{i}" for i in range(side + 1)]
    grid = [0.001, 0.01, 0.1, 1.0, 100.0]
    l2, losses = choose_l2(x[fit], y[fit], grid, folds=5, free=(side,))
    assert set(losses) == set(grid) and l2 >= 0.1 and losses[l2] == min(losses.values())
    chosen = fit_logistic(x[fit], y[fit], names, l2, free=(side,))
    loose = fit_logistic(x[fit], y[fit], names, 0.001, free=(side,))
    assert abs(chosen.weights[side]) > 0.5  # the free feature keeps its weight under the large penalty
    assert auroc(chosen.predict(x[held]), y[held]) > auroc(loose.predict(x[held]), y[held])
    assert auroc(chosen.predict(x[held]), y[held]) > auroc(free[held], y[held]) - 0.05
    # the side features carry the signal: a small penalty wins and beats the free feature alone
    y2 = (rng.random(n) < 1 / (1 + np.exp(-(1.5 * free + 2.0 * noise[:, 0] - 2.0 * noise[:, 1])))).astype(float)
    l2, _ = choose_l2(x[fit], y2[fit], grid, folds=5, free=(side,))
    assert l2 <= 0.1
    model = fit_logistic(x[fit], y2[fit], names, l2, free=(side,))
    assert auroc(model.predict(x[held]), y2[held]) > auroc(free[held], y2[held]) + 0.05
    # one row of the smaller class: no fold can hold it out, the largest penalty is taken
    one = np.zeros(20)
    one[3] = 1
    assert choose_l2(x[:20], one, grid, free=(side,)) == (100.0, {})


def test_precision_at_recall():
    score = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    hit = np.array([1, 0, 1, 0, 1, 0])
    assert precision_at_recall(score, hit, 1 / 3) == (0.9, 1.0)
    assert precision_at_recall(score, hit, 2 / 3) == (0.7, pytest.approx(2 / 3))
    assert precision_at_recall(score, hit, 1.0) == (0.5, pytest.approx(0.6))
    assert precision_at_recall(score, np.zeros(6), 0.5) is None


def test_auroc_known_values(tmp_path):
    assert auroc(np.array([0.1, 0.2, 0.8, 0.9]), np.array([0, 0, 1, 1])) == 1.0
    assert auroc(np.array([0.5, 0.5]), np.array([0, 1])) == 0.5
    assert auroc(np.array([0.1, 0.2]), np.array([1, 1])) is None  # one class: undefined, not 0.5
    logits, labels = _overconfident(500)
    c = token_confidence(logits, labels)
    reliability_plot({"before": (c["confidence"], c["correct"])}, tmp_path / "r.png", "tokens")
    assert (tmp_path / "r.png").stat().st_size > 0

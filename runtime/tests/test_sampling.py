"""Sampling mode is exact in distribution: the Leviathan rule at one position, and end to end
through sd and pyramid-exact on tiny models (chi-square tests)."""

from __future__ import annotations

import numpy as np
from scipy.stats import chisquare

from kibidango.decode.distributions import Sampler, divergence, verify
from kibidango.decode.speculative import DecodeConfig, Decoder


def test_leviathan_rule_reproduces_the_target_distribution():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(8) * 0.7)
    q = rng.dirichlet(np.ones(8) * 0.7)
    sampler = Sampler(temperature=1.0)
    counts = np.zeros(8)
    for _ in range(40000):
        x = int(rng.choice(8, p=q))
        n, token = verify([x], [q], [p], sampler, rng)
        counts[x if n == 1 else token] += 1
    assert chisquare(counts, 40000 * p).pvalue > 0.001
    # and it is not the draft's distribution
    assert chisquare(counts, 40000 * q).pvalue < 1e-6


def _first_tokens(models, cfg_kw, n):
    counts = {}
    for seed in range(n):
        cfg = DecodeConfig(max_new_tokens=2, temperature=1.0, seed=seed, **cfg_kw)
        first = next(Decoder(models).generate([1, 5, 9], cfg))[0]
        counts[first] = counts.get(first, 0) + 1
    return counts


def test_sd_and_pyramid_exact_sampling_match_the_target(family):
    target = family["target"].new_session()
    logits = target.feed([1, 5, 9])[-1]
    p = Sampler(temperature=1.0).probs(logits)
    support = np.flatnonzero(p > 0.02)  # pool the tail so expected counts are not tiny
    n = 1500
    for kw in (
        {"mode": "sd", "k": 1},
        {"mode": "pyramid", "variant": "exact", "l_D": 1, "l_Q": 1},
        {"mode": "sd", "k": 2, "p_min": 0.3},  # a draft that stops on its own samples keeps the target's law
        {"mode": "pyramid", "variant": "exact", "l_D": 2, "l_Q": 2, "p_min": 0.3},
    ):
        counts = _first_tokens(family, kw, n)
        observed = [counts.get(int(t), 0) for t in support] + [n - sum(counts.get(int(t), 0) for t in support)]
        expected = [n * p[t] for t in support] + [n * (1 - p[support].sum())]
        assert chisquare(observed, expected).pvalue > 0.001, kw


def test_divergences():
    p, q = np.array([0.5, 0.5, 0.0]), np.array([0.0, 0.5, 0.5])
    assert divergence(p, q, "tv") == 0.5
    assert divergence(p, p, "kl") == 0.0 and divergence(p, q, "js") <= np.log(2) + 1e-9
    top = Sampler(temperature=1.0, top_p=0.6).probs(np.log(np.array([0.5, 0.3, 0.2])))
    assert np.allclose(top, [0.625, 0.375, 0.0])


def test_a_certain_proposal_verified_by_the_rule_keeps_the_target_distribution():
    """lookup's proposals have a one-token distribution: accepted with probability p(x), else a
    draw from p without x — still exactly p."""
    rng = np.random.default_rng(1)
    p = rng.dirichlet(np.ones(8) * 0.7)
    q = np.zeros(8)
    q[3] = 1.0
    sampler = Sampler(temperature=1.0)
    counts = np.zeros(8)
    for _ in range(40000):
        n, token = verify([3], [q], [p], sampler, rng)
        counts[3 if n == 1 else token] += 1
    assert chisquare(counts, 40000 * p).pvalue > 0.001
    # None is that one-hot, never built: the same verdicts draw for draw, fuzzy acceptance included
    for tau in (0.0, 0.6):
        a, b = np.random.default_rng(7), np.random.default_rng(7)
        for _ in range(2000):
            assert verify([3], [q], [p], sampler, a, tau=tau) == verify([3], [None], [p], sampler, b, tau=tau)

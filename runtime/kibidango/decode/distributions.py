"""Next-token distributions, divergences between them, and the acceptance rule of speculative
decoding (Leviathan et al. 2023, arXiv 2211.17192; Pyramid SD, arXiv 2510.12966). Float64 numpy throughout: the
vocabularies involved are small
enough, and exactness tests compare probabilities."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

__all__ = ["Sampler", "divergence", "verify"]

_EPS = 1e-12


@dataclass(frozen=True)
class Sampler:
    """Turns logits into a distribution and draws from it. ``temperature == 0`` is greedy: the
    draw is the argmax, and the distribution is the plain softmax (temperature 1), so that a
    divergence between two models measures how their next-token distributions differ (between
    one-hot distributions it could only be 0 or 1, and fuzzy acceptance would be argmax matching)."""

    temperature: float = 0.0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def probs(self, logits: np.ndarray) -> np.ndarray:
        """The distribution of one row of logits, computed in place in one float64 copy of it (a
        49K vocabulary's row is 393 KB; each temporary of it counted in a request's peak memory)."""
        p = np.array(logits, dtype=np.float64)
        if not self.greedy:
            p /= self.temperature
        p -= p.max()
        np.exp(p, out=p)
        p /= p.sum()
        if self.top_p < 1.0 and not self.greedy:
            order = np.argsort(-p, kind="stable")
            before = np.cumsum(p[order])
            before -= p[order]  # the mass ahead of each token
            p[order[before >= self.top_p]] = 0.0  # keep the smallest set reaching top_p
            p /= p.sum()
        return p

    def draw(self, p: np.ndarray, rng: np.random.Generator) -> int:
        if self.greedy:
            return int(np.argmax(p))
        return int(rng.choice(len(p), p=p))


def divergence(p: np.ndarray, q: np.ndarray, kind: str = "tv") -> float:
    """Distance between two next-token distributions at one position.
    ``tv`` total variation 0.5*sum|p-q| in [0, 1]; ``js`` Jensen-Shannon (nats, <= ln 2);
    ``kl`` KL(p || q) (nats)."""
    if kind == "tv":
        return 0.5 * float(np.abs(p - q).sum())
    if kind == "kl":
        return float(np.sum(np.where(p > 0, p * (np.log(p + _EPS) - np.log(q + _EPS)), 0.0)))
    if kind == "js":
        m = 0.5 * (p + q)
        return 0.5 * divergence(p, m, "kl") + 0.5 * divergence(q, m, "kl")
    raise ValueError(f"unknown divergence {kind!r}: use tv, js or kl")


def verify(
    proposed: list[int],
    q_dists: Iterable[np.ndarray | None],
    p_dists: Iterable[np.ndarray],
    sampler: Sampler,
    rng: np.random.Generator,
    tau: float = 0.0,
    div: str = "tv",
) -> tuple[int, int | None]:
    """Verify ``proposed`` tokens (drawn from ``q_dists``) against the verifier's ``p_dists``.

    Token i is accepted when ``Div(p_i, q_i) <= tau`` (fuzzy acceptance; never with tau = 0
    unless the two distributions are equal) or when the lossless rule accepts it: in greedy mode
    the token equals argmax p_i, in sampling mode a uniform draw is below min(1, p_i(x)/q_i(x))
    (Leviathan et al.). At the first rejection the verifier's token replaces it: argmax p_i, or
    a draw from norm(max(0, p_i - q_i)). If every token passes, the caller draws the bonus token
    (from the verifier's next row: its distribution is made only then).

    ``q_dists`` and ``p_dists`` are read in step with ``proposed`` and no further (generators that
    make each distribution as it is reached hold one at a time); a ``q_dists`` entry None is a
    certain proposal (the one-hot distribution at its token, never built).

    Returns (number accepted, the replacement token, or None when every token passed)."""
    for i, (x, q, p) in enumerate(zip(proposed, q_dists, p_dists)):
        if tau > 0 and divergence(p, np.eye(1, len(p), x)[0] if q is None else q, div) <= tau:
            continue
        if sampler.greedy:
            if x == int(np.argmax(p)):
                continue
            return i, int(np.argmax(p))
        if rng.random() < min(1.0, p[x] / (1.0 if q is None else max(q[x], _EPS))):
            continue
        if q is None:  # max(p - one-hot(x), 0): p without x
            residual = p.copy()
            residual[x] = 0.0
        else:
            residual = np.maximum(p - q, 0.0)
        total = residual.sum()
        # p == q up to rounding cannot reject in exact arithmetic; fall back to p itself.
        residual = residual / total if total > _EPS else p
        return i, int(rng.choice(len(p), p=residual))
    return len(proposed), None

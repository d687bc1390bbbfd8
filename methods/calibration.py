"""Confidence calibration (stage 2G): temperature scaling of next-token distributions, Platt
scaling of answer-level features, and the measures that say whether either helped.

- :func:`fit_temperature`: the T > 0 minimising the NLL of ``softmax(logits / T)`` on the labels
  (one parameter, fitted on log T with L-BFGS, so T stays positive);
- :func:`ece`: expected calibration error with **equal-mass** bins by default (edges at the
  confidences' quantiles, so each bin holds about the same number of predictions and a skewed
  confidence distribution does not leave most bins empty; equal confidences share a bin), or
  equal-width bins;
- :func:`fit_logistic`: logistic regression from answer features to P(the judge passes) (Platt
  scaling; 6B's detector too), fitted with L-BFGS and a small L2 penalty on standardised
  features (features named free go unpenalised), returned as the runtime's
  :class:`kibidango.addons.confidence.Logistic`; :func:`choose_l2`, its penalty by stratified
  k-fold cross-validation;
- :func:`brier`, :func:`auroc`, :func:`precision_at_recall`, :func:`reliability_plot`.

Everything here is numpy/torch: the parameters are small JSON the runtime can read without the
pipeline or scikit-learn.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kibidango.addons.confidence import Logistic

__all__ = [
    "auroc",
    "brier",
    "choose_l2",
    "ece",
    "fit_logistic",
    "fit_temperature",
    "precision_at_recall",
    "reliability_plot",
    "token_confidence",
]


def fit_temperature(logits: np.ndarray, labels: np.ndarray, max_iter: int = 100) -> float:
    """The temperature minimising mean NLL of ``labels`` under ``softmax(logits / T)``
    (``logits``: [N, V], ``labels``: [N] token ids)."""
    import torch

    x = torch.as_tensor(np.asarray(logits), dtype=torch.float64)
    y = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    log_t = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([log_t], lr=0.5, max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(x / log_t.exp(), y)
        loss.backward()
        return loss

    opt.step(closure)
    return float(log_t.detach().exp())


def token_confidence(logits: np.ndarray, labels: np.ndarray, temperature: float = 1.0) -> dict[str, np.ndarray]:
    """Per position: the top-1 probability (``confidence``), whether top-1 is the label
    (``correct``) and the label's NLL, under ``softmax(logits / temperature)``."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    z = z - z.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    top = logp.argmax(axis=-1)
    labels = np.asarray(labels)
    return {
        "confidence": np.exp(logp.max(axis=-1)),
        "correct": (top == labels).astype(np.float64),
        "nll": -logp[np.arange(len(labels)), labels],
    }


def ece(confidence: np.ndarray, correct: np.ndarray, bins: int = 15, scheme: str = "equal_mass") -> float:
    """Expected calibration error: sum over bins of (bin share) x |accuracy - mean confidence|."""
    conf, hit = np.asarray(confidence, dtype=np.float64), np.asarray(correct, dtype=np.float64)
    if conf.size == 0:
        return 0.0
    total = 0.0
    for members in _bins(conf, bins, scheme):
        if members.size:
            total += members.size / conf.size * abs(hit[members].mean() - conf[members].mean())
    return float(total)


def _bins(conf: np.ndarray, bins: int, scheme: str) -> list[np.ndarray]:
    if scheme == "equal_mass":
        # edges at the confidences' quantiles; equal confidences share a bin (splitting ties would
        # make the figure depend on the rows' order), so tied data can leave fewer, fuller bins
        edges = np.quantile(conf, np.linspace(0, 1, bins + 1)[1:-1])
        index = np.searchsorted(edges, conf, side="right")
        return [b for b in (np.flatnonzero(index == i) for i in range(bins)) if b.size]
    if scheme == "equal_width":
        edges = np.linspace(0, 1, bins + 1)
        index = np.clip(np.searchsorted(edges, conf, side="right") - 1, 0, bins - 1)
        return [np.flatnonzero(index == b) for b in range(bins)]
    raise ValueError(f"unknown binning {scheme!r}: equal_mass or equal_width")


def brier(probability: np.ndarray, outcome: np.ndarray) -> float:
    p, y = np.asarray(probability, dtype=np.float64), np.asarray(outcome, dtype=np.float64)
    return float(np.mean((p - y) ** 2)) if p.size else 0.0


def auroc(score: np.ndarray, outcome: np.ndarray) -> float | None:
    """Area under the ROC curve (rank statistic, ties averaged); None with one class only."""
    s, y = np.asarray(score, dtype=np.float64), np.asarray(outcome, dtype=bool)
    pos, neg = int(y.sum()), int((~y).sum())
    if pos == 0 or neg == 0:
        return None
    order = np.argsort(s, kind="stable")
    ranks = np.empty(len(s))
    sorted_s = s[order]
    i = 0
    while i < len(s):  # average ranks over ties
        j = i
        while j + 1 < len(s) and sorted_s[j + 1] == sorted_s[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return float((ranks[y].sum() - pos * (pos + 1) / 2) / (pos * neg))


def paired_auroc_difference(a, b, outcome, rounds: int = 2000, seed: int = 0) -> dict:
    """AUROC of scores ``a`` minus that of scores ``b`` for the same ``outcome`` (the same answers),
    with a paired bootstrap 95% interval over the answers (resamples with one class skipped);
    ``difference`` None when the outcome has one class."""
    a, b, y = (np.asarray(x, dtype=np.float64) for x in (a, b, outcome))
    point_a, point_b = auroc(a, y), auroc(b, y)
    if point_a is None or point_b is None:
        return {"difference": None, "ci": None}
    rng = np.random.default_rng(seed)
    diffs = []
    for _ in range(rounds):
        idx = rng.integers(0, len(y), size=len(y))
        da, db = auroc(a[idx], y[idx]), auroc(b[idx], y[idx])
        if da is not None and db is not None:
            diffs.append(da - db)
    ci = [float(np.quantile(diffs, 0.025)), float(np.quantile(diffs, 0.975))] if diffs else None
    return {"difference": point_a - point_b, "ci": ci}


def fit_logistic(
    x: np.ndarray, y: np.ndarray, features: list[str], l2: float = 1e-3, free: tuple[int, ...] = ()
) -> Logistic:
    """Logistic regression on standardised features, fitted with L-BFGS and an L2 penalty: the
    runtime's :class:`kibidango.addons.confidence.Logistic` (Platt scaling is the one-feature case).
    ``free``: indices of features whose weights are not penalised (a large ``l2`` then leaves a model
    of those features alone, not a constant)."""
    import torch

    x = np.asarray(x, dtype=np.float64)
    mean, std = x.mean(axis=0), x.std(axis=0)
    std = np.where(std > 1e-12, std, 1.0)
    xs = torch.as_tensor((x - mean) / std)
    ys = torch.as_tensor(np.asarray(y, dtype=np.float64))
    penalised = torch.ones(x.shape[1], dtype=torch.float64)
    penalised[list(free)] = 0.0
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=0.5, max_iter=200, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(xs @ w + b, ys) + l2 * (penalised * w**2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return Logistic(list(features), w.detach().tolist(), float(b.detach()), mean.tolist(), std.tolist())


def choose_l2(
    x: np.ndarray,
    y: np.ndarray,
    grid: list[float],
    folds: int = 5,
    free: tuple[int, ...] = (),
    seed: int = 0,
) -> tuple[float, dict[float, float]]:
    """The penalty of ``grid`` whose :func:`fit_logistic` has the lowest mean held-out log loss over
    stratified ``folds``-fold cross-validation of ``(x, y)`` (each class dealt round-robin over the
    folds after a seeded shuffle), and that loss per penalty. Fewer folds when the smaller class
    has fewer rows than ``folds``; with under 2 rows in it, no fold can hold both classes out and
    the largest penalty is taken (no losses)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    grid = sorted(float(v) for v in grid)
    minority = int(min(y.sum(), len(y) - y.sum()))
    k = min(folds, minority)
    if k < 2:
        return grid[-1], {}
    rng = np.random.default_rng(seed)
    fold = np.empty(len(y), dtype=int)
    for label in (0.0, 1.0):
        rows = rng.permutation(np.flatnonzero(y == label))
        fold[rows] = np.arange(len(rows)) % k
    names = [f"x{i}" for i in range(x.shape[1])]
    losses = {}
    for l2 in grid:
        total = 0.0
        for f in range(k):
            train, test = fold != f, fold == f
            p = fit_logistic(x[train], y[train], names, l2, free).predict(x[test])
            p = np.clip(p, 1e-9, 1 - 1e-9)
            total -= float((y[test] * np.log(p) + (1 - y[test]) * np.log(1 - p)).sum())
        losses[l2] = total / len(y)
    best = min(grid, key=lambda v: (losses[v], -v))  # a tie goes to the larger penalty
    return best, losses


def precision_at_recall(score: np.ndarray, outcome: np.ndarray, recall: float) -> tuple[float, float] | None:
    """The highest score threshold whose recall of ``outcome`` reaches ``recall``, and the
    precision there (None without a positive)."""
    s, y = np.asarray(score, dtype=np.float64), np.asarray(outcome, dtype=bool)
    if not y.any():
        return None
    order = np.argsort(-s, kind="stable")
    hits = np.cumsum(y[order])
    need = int(np.ceil(recall * y.sum()))
    k = int(np.argmax(hits >= need))  # first position (highest threshold) reaching the recall
    k = max(i for i in range(k, len(s)) if s[order[i]] == s[order[k]])  # ties go in together
    return float(s[order[k]]), float(hits[k] / (k + 1))


def reliability_plot(curves: dict[str, tuple[np.ndarray, np.ndarray]], path: Path, title: str, bins: int = 15) -> None:
    """Accuracy against mean confidence per equal-mass bin, one line per curve (name -> (confidence,
    correct)), beside the diagonal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.2, 4.2))
    ax.plot([0, 1], [0, 1], color="#999", lw=1, ls="--")
    for name, (conf, hit) in curves.items():
        conf, hit = np.asarray(conf), np.asarray(hit)
        groups = _bins(conf, bins, "equal_mass")
        ax.plot([conf[g].mean() for g in groups], [hit[g].mean() for g in groups], marker="o", ms=3, label=name)
    ax.set_xlabel("confidence")
    ax.set_ylabel("accuracy")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

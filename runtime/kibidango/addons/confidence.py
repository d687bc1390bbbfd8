"""How sure the target is of an answer it wrote, calibrated (stage 2G), and how likely the answer
is to fail (stage 6B's escalation detector) — numpy only, from small JSON files in the bundle.

- :func:`answer_features`: from the target's logits over the answer (one forward pass of prompt +
  answer), the features stage 2G fits on: mean and min token log-probability, mean entropy, the
  length, and the mean log-probability under the calibrated temperature; :class:`AnswerStats`:
  the same features reduced token by token as the answer is decoded (no second pass, no rows kept);
- :class:`Logistic`: ``sigmoid(w . (x - mean) / std + b)``, the form of both 2G's Platt scaling
  and 6B's detector;
- :class:`Calibrator` (``calibration/calibration.json``): per-backend token temperature, the
  answer-level Platt model, and the decoding of the answers it was fitted on (``decoding``:
  greedy); ``confidence(features)`` is P(the judge passes the answer) — for an answer decoded
  that way: a sampled answer is another distribution (the cascade decodes with ``decoding``);
- :class:`EscalationDetector` (``escalation/escalation.json``): P(the local answer fails) from the
  query's hashed n-grams (:func:`kibidango.addons.router.features`) and the calibrated confidence.

The pipeline fits these with the same feature code (it imports this module), so training and
serving cannot disagree on a feature.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kibidango.integrity import BundleError, read_json

__all__ = [
    "ANSWER_FEATURES",
    "AnswerStats",
    "Calibrator",
    "EscalationDetector",
    "Logistic",
    "answer_features",
    "score_answer",
]

ANSWER_FEATURES = ("mean_logprob", "min_logprob", "mean_entropy", "tokens", "calibrated_mean_logprob")


TEMPERATURE_RANGE = (1e-2, 1e2)

_ROWS = 8
"""Answer rows :func:`answer_features` computes at once (its memory, not its values, depends on it)."""


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def _per_token(rows: np.ndarray, tokens: np.ndarray, temperature: float) -> tuple[np.ndarray, ...]:
    """Each row's log-probability of its token, entropy, and log-probability of its token under
    ``temperature`` (float64 temporaries of the rows' size)."""
    idx = (np.arange(len(tokens)), tokens)
    logp = _log_softmax(rows)
    entropy = -(np.exp(logp) * logp).sum(axis=-1)
    calibrated = logp if temperature == 1.0 else _log_softmax(np.asarray(rows) / temperature)  # x / 1.0 is x
    return logp[idx], entropy, calibrated[idx]


def _features(token_logp: np.ndarray, entropy: np.ndarray, calibrated: np.ndarray) -> dict[str, float]:
    return {
        "mean_logprob": float(token_logp.mean()),
        "min_logprob": float(token_logp.min()),
        "mean_entropy": float(entropy.mean()),
        "tokens": float(len(token_logp)),
        "calibrated_mean_logprob": float(calibrated.mean()),
    }


def answer_features(logits: np.ndarray, answer_ids: list[int], temperature: float = 1.0) -> dict[str, float] | None:
    """Features of an answer from the logits that predicted its tokens (``logits[i]`` predicts
    ``answer_ids[i]``); None for an empty answer."""
    n = len(answer_ids)
    if n == 0:
        return None
    logits = np.asarray(logits)[:n]
    answer = np.asarray(answer_ids)
    token_logp, entropy, calibrated = np.empty(n), np.empty(n), np.empty(n)
    for lo in range(0, n, _ROWS):  # a few rows at a time: float64 temporaries of a 49K vocabulary are 393 KB a row
        hi = min(lo + _ROWS, n)
        token_logp[lo:hi], entropy[lo:hi], calibrated[lo:hi] = _per_token(logits[lo:hi], answer[lo:hi], temperature)
    return _features(token_logp, entropy, calibrated)


class AnswerStats:
    """What :func:`answer_features` reads of each token, reduced from its logits row as the answer
    is decoded (``Metrics.answer_stats``, filled in every mode): three floats a token, where
    keeping the rows until the answer was scored held the vocabulary's logits for every token (196 KB
    a token for SmolLM2's 49K, +20 MB of peak RSS on a 32-token answer) and scoring with a second
    forward pass doubles the prefill. ``temperature``: the calibrated feature's (the calibrator's)."""

    def __init__(self, temperature: float = 1.0):
        self.temperature = float(temperature)
        self._values: list[tuple[float, float, float]] = []

    def __len__(self) -> int:
        return len(self._values)

    def add(self, row: np.ndarray, token: int) -> None:
        """The row of logits that chose ``token``."""
        logp, entropy, calibrated = _per_token(np.asarray(row)[None], np.asarray([token]), self.temperature)
        self._values.append((float(logp[0]), float(entropy[0]), float(calibrated[0])))

    def features(self, n: int) -> dict[str, float] | None:
        """:func:`answer_features` of the first ``n`` tokens (None for none)."""
        if n < 1:
            return None
        if n > len(self._values):
            raise ValueError(f"features of {n} tokens asked for, {len(self._values)} decoded")
        return _features(*(np.asarray(column) for column in zip(*self._values[:n], strict=True)))


def score_answer(
    model,
    prompt_ids: list[int],
    answer_ids: list[int],
    temperature: float = 1.0,
    stats: AnswerStats | None = None,
) -> dict | None:
    """:func:`answer_features` of ``answer_ids`` after ``prompt_ids`` under ``model`` (a backend
    model): a fresh session fed the prompt, then the answer ``_ROWS`` tokens at a time, each row
    reduced as it comes (:class:`AnswerStats`), cut to the model's context: one pass over the answer
    asking for all its rows at once held them twice (the backend's output buffer and the array), +28 MB
    of peak RSS for SmolLM2 after a 32-token `lookup` answer. ``stats``: the answer's
    :class:`AnswerStats` as it was decoded (``Metrics.answer_stats``), when it holds every token: then
    no forward pass (the same values up to floating-point rounding)."""
    if stats is not None and len(answer_ids) and len(stats) >= len(answer_ids):
        if stats.temperature != float(temperature):
            raise ValueError(f"the answer's stats were taken at temperature {stats.temperature}, not {temperature}")
        return stats.features(len(answer_ids))
    ids = (list(prompt_ids) + list(answer_ids))[: model.context_length]
    n = len(ids) - len(prompt_ids)
    if n < 1 or not prompt_ids:
        return None
    answer, session, scored = ids[len(prompt_ids) :], model.new_session(), AnswerStats(temperature)
    scored.add(session.feed(list(prompt_ids), first=len(prompt_ids) - 1)[-1], answer[0])
    for lo in range(0, n - 1, _ROWS):  # the last answer token predicts nothing we score
        chunk = answer[lo : min(lo + _ROWS, n - 1)]
        for i, row in enumerate(session.feed(chunk)):
            scored.add(row, answer[lo + i + 1])
    return scored.features(n)


@dataclass
class Logistic:
    """P = sigmoid(w . (x - mean) / std + b) over named features."""

    features: list[str]
    weights: list[float]
    bias: float
    mean: list[float]
    std: list[float]

    @classmethod
    def from_dict(cls, d: dict, where: str) -> Logistic:
        try:
            m = cls(
                list(d["features"]),
                [float(x) for x in d["weights"]],
                float(d["bias"]),
                [float(x) for x in d["mean"]],
                [float(x) for x in d["std"]],
            )
        except (KeyError, TypeError, ValueError) as e:
            raise BundleError(f"{where}: not a logistic model: {e}") from None
        n = len(m.features)
        if not (len(m.weights) == len(m.mean) == len(m.std) == n):
            raise BundleError(f"{where}: {n} features but {len(m.weights)} weights / {len(m.mean)} means")
        values = np.asarray([*m.weights, m.bias, *m.mean, *m.std])
        if not np.isfinite(values).all() or min(m.std, default=1.0) <= 0:
            raise BundleError(f"{where}: non-finite weights or a non-positive scale")
        return m

    def to_dict(self) -> dict:
        return asdict(self)

    def predict(self, x: np.ndarray) -> np.ndarray:
        x = np.atleast_2d(np.asarray(x, dtype=np.float64))
        with np.errstate(all="ignore"):  # an overflow shows as NaN, which the callers check
            # elementwise, not a BLAS matmul: inf - inf must stay NaN for the checks to see it
            z = (((x - np.asarray(self.mean)) / np.asarray(self.std)) * np.asarray(self.weights)).sum(
                axis=1
            ) + self.bias
            return 1.0 / (1.0 + np.exp(-np.clip(z, -500, 500)))


def _valid_decoding(d: Any) -> bool:
    """``{"temperature": t in [0, 2], "max_new_tokens": n >= 1 (optional)}``."""
    if not isinstance(d, dict):
        return False
    t, n = d.get("temperature"), d.get("max_new_tokens", 1)
    number = isinstance(t, int | float) and not isinstance(t, bool) and 0 <= t <= 2
    return number and isinstance(n, int) and not isinstance(n, bool) and n >= 1


@dataclass
class Calibrator:
    """Stage 2G's ``calibration.json``: ``{"schema": 1, "temperature": {"torch": T, "llamacpp": T},
    "answer": <Logistic over ANSWER_FEATURES> | null, "decoding": {"temperature": 0.0,
    "max_new_tokens": n}, "metrics": {...}}``. Without an answer model (one label class in the
    fitting data) the confidence is exp(calibrated mean log-probability). ``decoding``: how the
    answers it was fitted on were decoded (absent in files written before the field: every 2G
    decoded greedily, so absent means greedy)."""

    temperature: dict[str, float]
    answer: Logistic | None
    metrics: dict[str, Any] = field(default_factory=dict)
    decoding: dict[str, Any] = field(default_factory=lambda: {"temperature": 0.0})

    @classmethod
    def load(cls, path: str | Path) -> Calibrator:
        spec = read_json(Path(path), f"{path}: no calibration file")
        if not isinstance(spec, dict) or spec.get("schema") != 1:
            raise BundleError(f"{path}: unknown calibration schema")
        temps = spec.get("temperature")
        if not isinstance(temps, dict) or not all(
            isinstance(t, int | float) and np.isfinite(t) and t > 0 for t in temps.values()
        ):
            raise BundleError(f"{path}: temperature must map a backend to a positive number")
        if not all(TEMPERATURE_RANGE[0] <= t <= TEMPERATURE_RANGE[1] for t in temps.values()):
            raise BundleError(f"{path}: a temperature outside {TEMPERATURE_RANGE} (no calibration fits one)")
        answer = Logistic.from_dict(spec["answer"], f"{path}: answer") if spec.get("answer") else None
        if answer is not None and not set(answer.features) <= set(ANSWER_FEATURES):
            raise BundleError(f"{path}: unknown answer features {sorted(set(answer.features) - set(ANSWER_FEATURES))}")
        decoding = spec.get("decoding", {"temperature": 0.0})
        if not _valid_decoding(decoding):
            raise BundleError(
                f"{path}: decoding: a temperature in [0, 2] and an optional max_new_tokens >= 1, got {decoding!r}"
            )
        calibrator = cls({k: float(v) for k, v in temps.items()}, answer, spec.get("metrics", {}), dict(decoding))
        calibrator.probe(path)
        return calibrator

    def probe(self, where) -> None:
        """Refuse a calibrator that gives anything but a finite confidence in [0, 1] on answers like
        the ones it will see (finite weights can still overflow: 1e308 over a std of 1e-308)."""
        rng = np.random.default_rng(0)
        for backend in self.temperature:
            for scale in (0.1, 1.0, 10.0):
                logits = rng.normal(0.0, scale, size=(8, 64))
                feats = answer_features(logits, list(rng.integers(0, 64, size=8)), self.temperature_for(backend))
                with np.errstate(all="ignore"):
                    value = self.confidence(feats)
                if not (np.isfinite(value) and 0.0 <= value <= 1.0):
                    raise BundleError(
                        f"{where}: the calibrator gives {value!r} on a probe answer ({backend}), not [0, 1]"
                    )

    def to_dict(self) -> dict:
        return {
            "schema": 1,
            "temperature": self.temperature,
            "answer": self.answer.to_dict() if self.answer else None,
            "decoding": self.decoding,
            "metrics": self.metrics,
        }

    def temperature_for(self, backend: str) -> float:
        return self.temperature.get(backend, self.temperature.get("torch", 1.0))

    def confidence(self, feats: dict[str, float] | None) -> float:
        """P(the answer passes its judge); 0 for no answer."""
        if feats is None:
            return 0.0
        if self.answer is None:
            return float(np.exp(feats["calibrated_mean_logprob"]))
        return float(self.answer.predict([feats[f] for f in self.answer.features])[0])


@dataclass
class EscalationDetector:
    """Stage 6B's ``escalation.json``: ``{"schema": 1, "query_features": {"kind": "hashed-ngrams",
    "dim": 128, "salt": ...}, "model": <Logistic over q0..q127 + confidence>, "threshold": t,
    "metrics": {...}}``; ``p_fail`` >= ``threshold`` flags the answer for escalation."""

    model: Logistic
    dim: int
    salt: str
    threshold: float
    metrics: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path) -> EscalationDetector:
        spec = read_json(Path(path), f"{path}: no escalation detector file")
        try:
            if spec.get("schema") != 1 or spec["query_features"].get("kind") != "hashed-ngrams":
                raise ValueError("unknown schema or query feature kind")
            query = spec["query_features"]
            dim, salt, threshold = int(query["dim"]), str(query["salt"]), float(spec["threshold"])
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise BundleError(f"{path}: not a valid escalation detector: {e}") from None
        model = Logistic.from_dict(spec["model"], f"{path}: model")
        if len(model.features) != dim + 1:
            raise BundleError(f"{path}: {len(model.features)} features, expected {dim} query dims + confidence")
        return cls(model, dim, salt, threshold, spec.get("metrics", {}))

    @staticmethod
    def feature_names(dim: int) -> list[str]:
        return [*(f"q{i}" for i in range(dim)), "confidence"]

    def vector(self, query: str, confidence: float) -> np.ndarray:
        from kibidango.addons.router import features

        return np.concatenate([features(query, self.dim, self.salt).astype(np.float64), [confidence]])

    def p_fail(self, query: str, confidence: float) -> float:
        return float(self.model.predict(self.vector(query, confidence))[0])

    def to_dict(self) -> dict:
        return {
            "schema": 1,
            "query_features": {"kind": "hashed-ngrams", "dim": self.dim, "salt": self.salt},
            "model": self.model.to_dict(),
            "threshold": self.threshold,
            "metrics": self.metrics,
        }

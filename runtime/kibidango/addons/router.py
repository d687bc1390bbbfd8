"""The domain router (stage 6A) as the runtime runs it: hashed n-gram features of the query and a
small MLP (128-64-32-K, ReLU), in numpy, from a JSON file — no scikit-learn, no torch, no pipeline.

Features (:func:`features`): the lowercased query's words and each word's character 3-grams
(with ``<`` and ``>`` boundary marks) are hashed (blake2b, a fixed salt) into ``dim`` buckets with
a sign hash, counted, ``log1p``-damped and L2-normalised. Chosen over the target's pooled hidden
state because the router decides *before* a model runs (which adapter to load), costs well under a
millisecond, and is the same for the torch and GGUF backends; code and math queries differ from
prose in exactly the surface features it sees (keywords, symbols, digits).

The pipeline (``methods/routing.py``) imports :func:`features` from here, so training and serving
cannot disagree on the features. File format (``router.json``)::

    {"schema": 1, "kind": "mlp", "features": {"kind": "hashed-ngrams", "dim": 128, "salt": "..."},
     "labels": ["base", "code", ...], "layers": [{"w": [[...]], "b": [...]}, ...], "metrics": {...}}
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kibidango.integrity import BundleError, read_json

__all__ = ["Router", "features"]

_WORD = re.compile(r"\w+|[^\w\s]")


def _bucket(token: str, dim: int, salt: str) -> tuple[int, float]:
    h = int.from_bytes(hashlib.blake2b(f"{salt}:{token}".encode(), digest_size=8).digest(), "big")
    return h % dim, (1.0 if (h >> 63) & 1 else -1.0)


def features(text: str, dim: int = 128, salt: str = "kibidango-router-v1") -> np.ndarray:
    """The query's hashed n-gram vector (float32, L2 norm 1, or all zeros for an empty query)."""
    vec = np.zeros(dim, dtype=np.float64)
    for word in _WORD.findall(text.lower()):
        grams = [f"w:{word}"]
        marked = f"<{word}>"
        grams += [f"c:{marked[i : i + 3]}" for i in range(max(1, len(marked) - 2))]
        for g in grams:
            i, sign = _bucket(g, dim, salt)
            vec[i] += sign
    vec = np.sign(vec) * np.log1p(np.abs(vec))
    norm = np.linalg.norm(vec)
    return (vec / norm if norm > 0 else vec).astype(np.float32)


@dataclass
class Router:
    labels: list[str]
    layers: list[tuple[np.ndarray, np.ndarray]]
    dim: int = 128
    salt: str = "kibidango-router-v1"
    metrics: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path) -> Router:
        spec = read_json(Path(path), f"{path}: no router file")
        try:
            if spec.get("schema") != 1 or spec.get("kind") != "mlp":
                raise ValueError(f"unknown router schema {spec.get('schema')!r} / kind {spec.get('kind')!r}")
            feats = spec["features"]
            if feats.get("kind") != "hashed-ngrams":
                raise ValueError(f"unknown feature kind {feats.get('kind')!r}")
            layers = [
                (np.asarray(x["w"], dtype=np.float32), np.asarray(x["b"], dtype=np.float32)) for x in spec["layers"]
            ]
            router = cls(list(spec["labels"]), layers, int(feats["dim"]), str(feats["salt"]), spec.get("metrics", {}))
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise BundleError(f"{path}: not a valid router: {e}") from None
        router._check()
        return router

    def _check(self) -> None:
        width = self.dim
        for i, (w, b) in enumerate(self.layers):
            if w.ndim != 2 or w.shape[0] != width or b.shape != (w.shape[1],):
                raise BundleError(f"router layer {i}: shape {w.shape} / {b.shape} does not follow width {width}")
            if not (np.isfinite(w).all() and np.isfinite(b).all()):
                raise BundleError(f"router layer {i}: non-finite weights")
            width = w.shape[1]
        if width != len(self.labels):
            raise BundleError(f"router: {width} outputs for {len(self.labels)} labels")

    def to_dict(self) -> dict:
        return {
            "schema": 1,
            "kind": "mlp",
            "features": {"kind": "hashed-ngrams", "dim": self.dim, "salt": self.salt},
            "labels": self.labels,
            "layers": [{"w": w.tolist(), "b": b.tolist()} for w, b in self.layers],
            "metrics": self.metrics,
        }

    def probabilities(self, texts: list[str]) -> np.ndarray:
        x = np.stack([features(t, self.dim, self.salt) for t in texts]) if texts else np.zeros((0, self.dim))
        for i, (w, b) in enumerate(self.layers):
            x = x @ w + b
            if i < len(self.layers) - 1:
                x = np.maximum(x, 0)
        x = x - x.max(axis=1, keepdims=True)
        p = np.exp(x)
        return p / p.sum(axis=1, keepdims=True)

    def route(self, text: str) -> tuple[str, float]:
        """The most probable label of ``text`` and its probability (the router's confidence)."""
        p = self.probabilities([text])[0]
        i = int(p.argmax())
        return self.labels[i], float(p[i])

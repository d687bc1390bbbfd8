"""The domain router a bundle ships (stage 6A's router.json): loaded only when listed and hashed,
refused when tampered with, and routing queries with numpy alone."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kibidango import BundleError, load_bundle, write_bundle
from kibidango.addons.router import Router, features
from tests.conftest import STORIES, needs_stories


def _router(seed: int = 0) -> Router:
    rng = np.random.default_rng(seed)
    sizes = [128, 64, 32, 4]
    layers = [(rng.normal(size=(a, b)).astype(np.float32), np.zeros(b, np.float32)) for a, b in zip(sizes, sizes[1:])]
    return Router(["code", "math", "general", "base"], layers)


def _bundle(tmp_path, router: Router):
    def finalize(tmp):
        (tmp / "router").mkdir()
        (tmp / "router" / "router.json").write_text(json.dumps(router.to_dict()))
        return {"router": "router/router.json"}

    return write_bundle(
        tmp_path / "bundle", {"target": {"hf": STORIES, "vocab_size": 512}}, {"mode": "ar"}, finalize, preset="test"
    )


def test_a_bundle_routes_with_the_router_it_ships(tmp_path):
    needs_stories()
    router = _router()
    bundle = load_bundle(_bundle(tmp_path, router))
    loaded = bundle.router()
    queries = ["def add(a, b): return a + b", "What is 12 + 30?", "Once upon a time"]
    assert np.allclose(loaded.probabilities(queries), router.probabilities(queries))
    label, confidence = loaded.route(queries[0])
    assert label in loaded.labels and 0 < confidence <= 1
    assert features("").sum() == 0 and abs(np.linalg.norm(features("hello world")) - 1) < 1e-6


def test_a_tampered_router_is_refused(tmp_path):
    needs_stories()
    root = _bundle(tmp_path, _router())
    spec = json.loads((root / "router" / "router.json").read_text())
    spec["labels"] = ["math", "code", "general", "base"]  # swap what two outputs mean
    (root / "router" / "router.json").write_text(json.dumps(spec))
    with pytest.raises(BundleError, match="router"):
        load_bundle(root)
    assert load_bundle(_bundle(tmp_path / "again", _router())).manifest.router == "router/router.json"
    plain = write_bundle(tmp_path / "plain", {"target": {"hf": STORIES, "vocab_size": 512}}, {"mode": "ar"})
    assert load_bundle(plain).router() is None  # a bundle without a router routes nothing


def test_a_router_without_adapters_reports_the_domain_and_runs_the_base(tmp_path):
    needs_stories()
    from kibidango import Pipeline

    pipe = Pipeline.from_bundle(_bundle(tmp_path, _router()), adapter="auto")
    assert pipe.adapters is None and pipe.adapter == "none"
    m = pipe.generate("def add(a, b): return a + b", max_new_tokens=2, adapter="auto").metrics
    assert m.domain in ("code", "math", "general", "base") and m.adapter is None and m.confidence is None

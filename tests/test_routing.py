"""The domain router (6A, started): hashed n-gram features + MLP trained on stage 0's labels beats
the majority class on the test split, and a label-shuffled control does not; the runtime's numpy
router reads back exactly what was trained and refuses a malformed file."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from core.paths import REPO_ROOT
from methods.routing import train_router
from tests.conftest import needs_shared


@pytest.fixture(scope="module")
def stage0(tmp_path_factory):
    needs_shared()
    import stages.curate as curate

    out = tmp_path_factory.mktemp("stage0")
    curate.run(curate.Config(**yaml.safe_load((REPO_ROOT / "recipes/stage0/tiny.yaml").read_text())), {}, out)
    return out


def test_the_router_beats_the_majority_class_and_a_shuffled_control_does_not(stage0, tmp_path):
    """Stage 6A with the tiny recipe on the real stage-0 output."""
    from kibidango.addons.router import Router
    from methods.training.adapter_manifest import write_adapter_manifest
    from stages.train_router import Config, run

    cfg = Config(**yaml.safe_load((REPO_ROOT / "recipes/stage6A/tiny.yaml").read_text()))
    adapters = {}
    for domain in ("code", "math", "general"):  # adapters their stages did not check: they ship
        adapters[domain] = tmp_path / "adapters" / domain
        adapters[domain].mkdir(parents=True)
        write_adapter_manifest(adapters[domain], {}, domain=domain, base_tier="target")
    # a preset that runs none of the adapter stages wires none: every query goes to the base weights
    (tmp_path / "alone").mkdir()
    alone = run(cfg, {"data": stage0}, tmp_path / "alone")
    assert json.loads((tmp_path / "alone" / "router.json").read_text())["labels"] == ["base"], alone.metrics
    out = tmp_path / "router"
    out.mkdir()
    result = run(cfg, {"data": stage0, **adapters}, out)
    m = result.metrics
    assert m["test_accuracy"] > m["majority_baseline"] + 0.05, m
    assert m["shuffled_label_control"] < m["test_accuracy"] - 0.2, m
    router = Router.load(out / "router.json")
    assert router.labels == ["code", "math", "general", "base"] and len(router.layers) == 3
    assert [w.shape for w, _ in router.layers] == [(128, 64), (64, 32), (32, 4)]
    assert "| code |" in (out / "ROUTER_CARD.md").read_text()


def test_the_runtime_router_reads_back_what_was_trained(tmp_path):
    from kibidango.addons.router import Router
    from kibidango.integrity import BundleError

    texts = ["def add(a, b): return a + b", "What is 12 + 30?", "Once upon a time a cat slept."]
    router = train_router(texts * 20, ["code", "math", "general"] * 20, ["code", "general", "math"], epochs=20)
    path = tmp_path / "router.json"
    path.write_text(json.dumps(router.to_dict()))
    loaded = Router.load(path)
    assert np.allclose(loaded.probabilities(texts), router.probabilities(texts), atol=1e-6)
    assert [loaded.route(t)[0] for t in texts] == ["code", "math", "general"]
    spec = router.to_dict()
    spec["layers"][0]["w"] = spec["layers"][0]["w"][:-1]  # a row short: shapes no longer chain
    path.write_text(json.dumps(spec))
    with pytest.raises(BundleError, match="router layer 0"):
        Router.load(path)
    path.write_text("[1, 2]")
    with pytest.raises(BundleError, match="not a valid router"):
        Router.load(path)

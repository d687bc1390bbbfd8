"""The domain router (6A, started): hashed n-gram features + MLP trained on stage 0's labels beats
the majority class on the test split, and a label-shuffled control does not; the runtime's numpy
router reads back exactly what was trained and refuses a malformed file."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import yaml

from core.paths import REPO_ROOT
from methods.routing import confusion, train_router
from tests.conftest import needs_shared


@pytest.fixture(scope="module")
def splits(tmp_path_factory):
    needs_shared()
    import stages.curate as curate
    from methods.training.chat import load_split

    out = tmp_path_factory.mktemp("stage0")
    curate.run(curate.Config(**yaml.safe_load((REPO_ROOT / "recipes/stage0/tiny.yaml").read_text())), {}, out)

    def rows(split):
        data = load_split(out / "dataset", split)
        return [r["instruction"] or r["output"][:200] for r in data], [r["domain"] for r in data]

    return rows("train"), rows("test")


def test_the_router_beats_the_majority_class_and_a_shuffled_control_does_not(splits):
    (train_x, train_y), (test_x, test_y) = splits
    labels = sorted(set(train_y))
    majority = max(test_y.count(d) for d in labels) / len(test_y)
    router = train_router(train_x, train_y, labels, epochs=15)
    result = confusion(router, test_x, test_y)
    assert result["accuracy"] > majority + 0.05, (result["accuracy"], majority)
    shuffled = train_y[:]
    random.Random(0).shuffle(shuffled)
    control = confusion(train_router(train_x, shuffled, labels, epochs=15), test_x, test_y)
    assert control["accuracy"] < result["accuracy"] - 0.2


def test_the_runtime_router_reads_back_what_was_trained(tmp_path):
    from kibidango.integrity import BundleError
    from kibidango.router import Router

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

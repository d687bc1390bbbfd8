"""Cascade configs: the plan's example shipped by name, the bundle's 6C thresholds under a user's
file, and clear errors naming the source and field (never echoing a key)."""

from __future__ import annotations

import json
import math

import pytest

from kibidango import write_bundle
from kibidango.bundle import load_bundle
from kibidango.cascade.config import CascadeConfigError, load_cascade
from tests.conftest import STORIES, needs_stories


def test_the_plans_example_by_name():
    c = load_cascade("plan-example")
    assert (c.draft_max_tokens, c.qualifier_threshold) == (256, 0.85)
    assert (c.cloud.fallback_threshold, c.cloud.budget_limit, c.cloud.budget_period) == (0.7, 10.0, "month")
    assert c.cloud.api_key_env == "OPENROUTER_API_KEY"
    assert load_cascade("local-only").cloud is None


def test_bundle_thresholds_under_a_user_file(tmp_path):
    needs_stories()
    chosen = {
        "schema": 1,
        "router": {"threshold": 0.5},
        "qualifier": {"threshold": 0.3},
        "cloud": {"fallback_threshold": 0.1, "model": "m", "usd_per_1k_prompt": 0.003, "usd_per_1k_completion": 0.015},
        "escalation": {"use_detector": True},
        "expected": {"quality": 0.4},
    }

    def finalize(tmp):
        (tmp / "cascade").mkdir()
        (tmp / "cascade" / "cascade.json").write_text(json.dumps(chosen))
        return {"cascade": "cascade/cascade.json"}

    bundle = load_bundle(write_bundle(tmp_path / "b", {"target": {"hf": STORIES, "vocab_size": 512}}, {}, finalize))
    assert load_cascade(bundle=bundle).cloud is None  # 6C gives thresholds and prices, not an endpoint
    user = tmp_path / "mine.json"
    user.write_text(json.dumps({"cloud": {"base_url": "http://127.0.0.1:9/v1", "api_key_env": "MY_KEY"}}))
    c = load_cascade(user, bundle=bundle)
    assert (c.router_threshold, c.qualifier_threshold, c.use_detector) == (0.5, 0.3, True)
    assert (c.cloud.fallback_threshold, c.cloud.model, c.cloud.base_url) == (0.1, "m", "http://127.0.0.1:9/v1")
    assert "cascade/cascade.json" in c.source and "mine.json" in c.source


_CLOUD = {
    "base_url": "http://127.0.0.1:9/v1",
    "model": "m",
    "api_key_env": "K",
    "usd_per_1k_prompt": 0.01,
    "usd_per_1k_completion": 0.02,
}


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"qualifier": {"threshold": 1.5}}, r"qualifier\.threshold: Input should be less than or equal to 1"),
        ({"qualifier": {"threshold": math.nan}}, r"qualifier\.threshold: Input should be a finite number"),
        (
            {"cloud": {**_CLOUD, "usd_per_1k_prompt": math.nan}},
            r"cloud\.usd_per_1k_prompt: Input should be a finite number",
        ),
        ({"cloud": {**_CLOUD, "budget_limit": math.nan}}, r"cloud\.budget_limit: Input should be a finite number"),
        ({"cloud": {**_CLOUD, "budget_limit": math.inf}}, r"cloud\.budget_limit: Input should be a finite number"),
        ({"cloud": {**_CLOUD, "max_tokens": math.inf}}, r"cloud\.max_tokens: Input should be a valid integer"),
        ({"cloud": {**_CLOUD, "max_tokens": 2.5}}, r"cloud\.max_tokens: Input should be a valid integer"),
        (
            {"cloud": {**_CLOUD, "max_tokens": 10**15}},
            r"cloud\.max_tokens: Input should be less than or equal to 1000000",
        ),
        ({"draft": {"max_tokens": -1}}, r"draft\.max_tokens: Input should be greater than or equal to 1"),
        ({"qualifer": {}}, r"qualifer: Extra inputs are not permitted"),
        ({"qualifier": {"threshold": True}}, r"qualifier\.threshold: Input should be a valid number"),
        ({"escalation": {"use_detector": "yes"}}, r"escalation\.use_detector: Input should be a valid boolean"),
        ({"cloud": {**_CLOUD, "max_retries": 3}}, r"cloud\.max_retries: Extra inputs"),  # one vocabulary: max_attempts
        ({"cloud": {**_CLOUD, "max_attempts": 0}}, r"cloud\.max_attempts: Input should be greater than or equal to 1"),
        (
            {
                "cloud": {
                    "base_url": "ftp://x",
                    "model": "m",
                    "api_key_env": "K",
                    "usd_per_1k_prompt": 0,
                    "usd_per_1k_completion": 0,
                }
            },
            r"cloud\.base_url: an http\(s\) URL",
        ),
        ({"cloud": {"base_url": "http://x"}}, r"(?s)cloud\.model: Field required.*cloud\.api_key_env: Field required"),
        (
            {"qualifier": {"threshold": 0.5}, "cloud": {**load_cascade("plan-example").cloud.model_dump()}},
            r"fallback_threshold is above qualifier\.threshold",
        ),
    ],
)
def test_bad_configs_name_the_file_and_field(tmp_path, doc, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(CascadeConfigError, match=message) as e:
        load_cascade(path)
    assert "bad.json" in str(e.value)


def test_a_key_where_its_variables_name_belongs_is_refused_without_echo(tmp_path):
    key = "sk-or-v1-" + "a" * 40
    path = tmp_path / "leaky.json"
    cloud = {**load_cascade("plan-example").cloud.model_dump(), "api_key_env": key}
    path.write_text(json.dumps({"cloud": cloud}))
    with pytest.raises(CascadeConfigError, match="NAME of an environment variable") as e:
        load_cascade(path)
    assert key not in str(e.value)
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(CascadeConfigError, match="broken.json: not valid JSON"):
        load_cascade(tmp_path / "broken.json")

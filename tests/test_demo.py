"""The tiny preset end to end, as `make demo` runs it (slow: `make test-slow`): stage 0 -> P ->
1A -> 1E -> 3-5 with real axolotl training; a rerun is all cache hits; a 1E recipe change
retrains 1E only."""

from __future__ import annotations

import re

import mlflow
import pytest

from flows.tracking import TAG
from tests.test_flow import _cli
from tests.test_training_resume import _needs_axolotl_and_shared


def _runs(stage: str) -> list:
    return mlflow.search_runs(experiment_names=["kibidango-tiny"], filter_string=f"tags.`{TAG}stage_id` = '{stage}'",
                              order_by=["attributes.start_time ASC"], output_format="list")  # fmt: skip


@pytest.mark.slow
def test_tiny_preset_end_to_end_rerun_and_one_recipe_change(tmp_path):
    _needs_axolotl_and_shared()
    home = tmp_path / "home"
    first = _cli(home, "run", "--preset", "tiny", timeout=3600)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "data card" in first.stdout
    assert "| tier | parameters | validation perplexity | greedy agreement vs target | expected acceptance vs target |" in first.stderr
    second = _cli(home, "run", "--preset", "tiny")
    assert second.returncode == 0 and "running (" not in second.stderr  # every stage a cache hit
    third = _cli(home, "run", "--preset", "tiny", "--set", "1E.kd_alpha=0.8", timeout=1800)
    assert third.returncode == 0, third.stderr[-3000:]
    ran = set(re.findall(r"stage (\w+) \([\w-]+\): running", third.stderr))
    assert ran == {"1E"}, f"a 1E recipe change reran {ran}"

    mlflow.set_tracking_uri(f"sqlite:///{home / 'mlflow.db'}")
    assert [r.data.tags[f"{TAG}cached"] for r in _runs("P")] == ["no", "yes", "yes"]
    assert [r.data.tags[f"{TAG}cached"] for r in _runs("1E")] == ["no", "yes", "no"]
    kd = _runs("1E")[0].data.metrics
    # KD helps: the distilled draft agrees with the target more than the same draft before KD.
    assert kd["draft_expected_acceptance_after"] > kd["draft_expected_acceptance_before"]
    assert kd["sd_acceptance_rate_after"] > kd["sd_acceptance_rate_before"]
    sft = _runs("1A")[0].data.metrics
    assert sft["val_loss_after"] < sft["val_loss_before"]
    for stage in ("3", "4", "5"):  # each domain adapter lowers its own domain's validation loss
        m = _runs(stage)[0].data.metrics
        assert m["domain_val_loss_adapter"] < m["domain_val_loss_base"], stage
    history = mlflow.MlflowClient().get_metric_history(_runs("P")[0].info.run_id, "P/target/loss")
    assert len(history) >= 5  # the loss curve reached MLflow while training

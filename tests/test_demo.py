"""The tiny preset end to end, as `make demo` runs it (slow: `make test-slow`)."""

from __future__ import annotations

import mlflow
import pytest

from flows.tracking import TAG
from tests.test_flow import _cli


@pytest.mark.slow
def test_tiny_preset_end_to_end_rerun_and_one_config_change(tmp_path):
    home = tmp_path / "home"
    first = _cli(home, "run", "--preset", "tiny", timeout=1800)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "data card" in first.stdout
    second = _cli(home, "run", "--preset", "tiny")
    assert second.returncode == 0 and "running (" not in second.stderr  # every stage a cache hit
    third = _cli(home, "run", "--preset", "tiny", "--set", "0.dedup.threshold=0.6")
    assert third.returncode == 0 and "stage 0 (curate): running (no cached artifact)" in third.stderr

    mlflow.set_tracking_uri(f"sqlite:///{home / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["kibidango-tiny"], filter_string=f"tags.`{TAG}stage_id` = '0'",
                              order_by=["attributes.start_time ASC"], output_format="list")  # fmt: skip
    assert [r.data.tags[f"{TAG}cached"] for r in runs] == ["no", "yes", "no"]
    assert runs[0].data.metrics["rows_out"] > 1000
    assert runs[2].data.params["dedup.threshold"] == "0.6"

"""The cached stage runner and its MLflow lineage, without Prefect (fast)."""

from __future__ import annotations

import json

import mlflow
import pytest

from flows.compare import compare_table
from flows.runner import RunContext, execute_stage
from flows.tracking import TAG, Tracker, flatten_params
from flows.workspace import tracking_uri
from stages import load_stage
from tests.conftest import write_jsonl

s0 = load_stage("0")


@pytest.fixture
def source(tmp_path):
    rows = [
        {
            "instruction": f"Explain idea number {i} about gardens and water.",
            "output": f"Idea {i}: plants need water {i} times.",
        }
        for i in range(30)
    ]
    return write_jsonl(tmp_path / "src.jsonl", rows)


def _ctx(workspace, parent, force=()):
    return RunContext("test", "exp-test", str(workspace / "store"), parent, "prefect-run-1", tuple(force))


def _runs(stage="0"):
    mlflow.set_tracking_uri(tracking_uri())
    return mlflow.search_runs(
        experiment_names=["exp-test"],
        filter_string=f"tags.`{TAG}stage_id` = '{stage}'",
        order_by=["attributes.start_time ASC"],
        output_format="list",
    )


def test_cache_hit_miss_force_and_lineage(workspace, source):
    parent = Tracker("exp-test").start_run("flow", {f"{TAG}preset": "test"})
    cfg = s0.Config(sources=[{"name": "src", "path": str(source), "format": "alpaca", "license": "MIT"}])

    first = execute_stage("0", cfg, {}, _ctx(workspace, parent))
    second = execute_stage("0", cfg, {}, _ctx(workspace, parent))
    assert second == first  # a hit returns the same artifact
    forced = execute_stage("0", cfg, {}, _ctx(workspace, parent, force=["0"]))
    assert forced.key == first.key and forced.digest == first.digest  # same bytes: downstream stays cached
    changed = execute_stage(
        "0", cfg.model_copy(update={"dedup": s0.DedupConfig(threshold=0.8)}), {}, _ctx(workspace, parent)
    )
    assert changed.key != first.key

    runs = _runs()
    assert [r.data.tags[f"{TAG}cached"] for r in runs] == ["no", "yes", "no", "no"]
    for r in runs:
        tags = r.data.tags
        assert tags["mlflow.parentRunId"] == parent
        assert tags[f"{TAG}prefect_flow_run_id"] == "prefect-run-1"
        assert tags[f"{TAG}stage_name"] == "curate"
        assert json.loads(tags[f"{TAG}input_digests"]).keys() == {"source:src"}
        assert r.data.metrics["rows_out"] == 30
        assert r.data.params["sources.0.name"] == "src" and "dedup.threshold" in r.data.params
    assert runs[1].data.tags[f"{TAG}source_run_id"] == runs[0].info.run_id
    assert {r.data.tags[f"{TAG}cache_key"] for r in runs[:3]} == {first.key}
    assert first.manifest["mlflow_run_id"] == runs[2].info.run_id  # the forced run published last
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(runs[0].info.run_id)}
    assert {"data_card.md", "length_histogram.png", "stats.json", "manifest.json"} <= artifacts

    table = compare_table("exp-test", ["rows_out", "duplicate_rate"], stage="0")
    assert len(table.splitlines()) == 2 + 4 and "rows_out" in table.splitlines()[0]


def test_a_forced_stage_whose_log_alone_changes_leaves_its_downstream_cached(workspace, source, monkeypatch):
    """A seeded retrain repeats its weights but never its logs/ (tokens/s, wall times): forced, it
    publishes the same digest, so the next stage's cache key (and its cached artifact) stays."""
    import uuid
    from pathlib import Path

    from flows.runner import stage_key

    real = s0.run

    def logged(cfg, inputs, out_dir):
        result = real(cfg, inputs, out_dir)
        (out_dir / "logs").mkdir()
        (out_dir / "logs" / "curate.log").write_text(f"this run: {uuid.uuid4().hex}, 1234.5 rows/s\n")
        return result

    monkeypatch.setattr(s0, "run", logged)
    cfg = s0.Config(sources=[{"name": "src", "path": str(source), "format": "alpaca", "license": "MIT"}])
    first = execute_stage("0", cfg, {}, _ctx(workspace, None))
    log_first = (Path(first.path) / "logs" / "curate.log").read_text()
    forced = execute_stage("0", cfg, {}, _ctx(workspace, None, force=["0"]))
    assert (Path(forced.path) / "logs" / "curate.log").read_text() != log_first
    assert forced.digest == first.digest
    downstream = load_stage("1A").Config.model_construct()
    assert stage_key("1A", downstream, {"data": forced}).key == stage_key("1A", downstream, {"data": first}).key


def test_a_failing_stage_publishes_nothing_and_marks_the_run_failed(workspace, tmp_path):
    bad = tmp_path / "src.json"
    bad.write_text('[{"instruction": "a", "output": "b"} {"oops"}]')
    cfg = s0.Config(sources=[{"name": "src", "path": str(bad), "format": "alpaca", "license": "MIT"}])
    with pytest.raises(Exception, match="malformed JSON"):
        execute_stage("0", cfg, {}, _ctx(workspace, None))
    left = [p.name for p in (workspace / "store" / "0").iterdir() if not p.name.startswith(".lock-")]
    assert not left  # staging discarded, nothing published (the key's lock file stays, released)
    (run,) = _runs()
    assert run.info.status == "FAILED"


def test_secrets_never_reach_mlflow_params():
    params = flatten_params({"cloud": {"api_key": "sk-live-123", "base_url": "https://x"}, "OPENAI_API_KEY": "sk-2"})
    assert params == {"cloud.api_key": "***", "cloud.base_url": "https://x", "OPENAI_API_KEY": "***"}


def test_a_mapping_keyed_by_patterns_is_one_param_mlflow_accepts(tmp_path):
    """2D's `tensors` maps llama.cpp name patterns to types: MLflow refuses `blk\\.(0|1)` as a param
    name (the small demo failed at 2D on it), so such a mapping is logged as one JSON value."""
    from mlflow.entities import Param
    from mlflow.tracking import MlflowClient

    config = {"fidelity": {"tensors": {r"blk\.(0|1)\.ffn_(gate|up)": "Q8_0", "ffn_down": "Q6_K"}, "quant": "Q4_0"}}
    params = flatten_params(config)
    assert params == {
        "fidelity.tensors": json.dumps({r"blk\.(0|1)\.ffn_(gate|up)": "Q8_0", "ffn_down": "Q6_K"}),
        "fidelity.quant": "Q4_0",
    }
    assert flatten_params({"odd": {"a|b": 1, "api_key": "sk-live-123"}}) == {"odd": '{"a|b": 1, "api_key": "***"}'}
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.create_run(client.create_experiment("params"))
    client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in params.items()])  # raised before
    assert client.get_run(run.info.run_id).data.params == params


def test_a_second_run_of_the_same_key_waits_instead_of_sharing_its_work_dir(workspace, source):
    """Two flows computing one key at once (a scheduled run and a manual one) would train into the
    same work directory; the second waits for the first's lock, then finds its artifact."""
    import threading
    import time

    from core.store import ArtifactStore
    from flows.runner import stage_key

    cfg = s0.Config(sources=[{"name": "src", "path": str(source), "format": "alpaca", "license": "MIT"}])
    key = stage_key("0", cfg, {}).key
    store = ArtifactStore(workspace / "store")
    results = []
    with store.computing("0", key):
        waiter = threading.Thread(target=lambda: results.append(execute_stage("0", cfg, {}, _ctx(workspace, None))))
        waiter.start()
        time.sleep(1.5)
        assert waiter.is_alive() and store.get("0", key) is None  # blocked on the lock, computed nothing
    waiter.join(120)
    assert results and store.get("0", key) == results[0]

"""The MLflow Model Registry: stage 9A, through the cached runner, registers the bundle it judged
as a version of ``kibidango-<preset>`` (verdict, digest, flow run, source runs as tags); the alias
``champion`` moves only to a releasable version; a cache hit adds no version; the runtime loads
``models:/kibidango-test@champion`` through MLflow's artifact download and verifies it like any
bundle; a tampered download is refused; ``make compare`` lists the versions with their figures."""

from __future__ import annotations

import json
import shutil

import pytest
from mlflow.tracking import MlflowClient

from eval.shared_data import SHARED

STORIES = SHARED / "models" / "stories260K" / "hf"


def _gates(maximum: float):
    from stages import load_stage

    gate = {"name": "gold-answer-perplexity", "input": "evaluation", "metric": "all/reference_perplexity"}
    return load_stage("9A").Config.model_validate({"gates": [{**gate, "max": maximum}], "backends": ["torch"]})


def test_9a_registers_every_judged_bundle_and_champion_follows_only_releasable_ones(workspace, monkeypatch):
    from core.contract import KibidangoError
    from core.store import ArtifactStore
    from flows.model_registry import model_name, versions_table
    from flows.runner import RunContext, execute_stage
    from flows.tracking import TAG, Tracker
    from flows.workspace import tracking_uri
    from kibidango import BundleError, Pipeline, load_bundle, write_bundle

    if not (STORIES / "model.safetensors").is_file():
        pytest.skip(f"needs stories260K at {STORIES}")
    store = ArtifactStore(workspace / "store")
    staging = store.new_staging_dir("X", "kx")
    write_bundle(staging / "bundle", {"target": {"hf": STORIES, "vocab_size": 512}}, {"mode": "ar", "stop_ids": [2]})
    bundle = store.publish("X", "kx", staging, {"metrics": {}})
    tracker = Tracker("exp-test")  # stage 9's run, whose figures make compare shows beside each version
    evaluation_run = tracker.start_run("9-evaluate", {})
    tracker.log_metrics(evaluation_run, {"gsm8k/auto/accuracy": 0.25, "all/reference_perplexity": 100.0})
    tracker.end_run(evaluation_run, ok=True)
    staging = store.new_staging_dir("9", "k9")
    (staging / "evaluation.json").write_text("{}")
    evaluation = store.publish(
        "9", "k9", staging, {"metrics": {"all/reference_perplexity": 100.0}, "mlflow_run_id": evaluation_run}
    )
    ctx = RunContext("test", "exp-test", str(workspace / "store"), None, "prefect-run-1", (), "abc123")
    inputs = {"bundle": bundle, "evaluation": evaluation}
    client = MlflowClient(tracking_uri())
    name = model_name("test")

    for _ in range(2):  # computed, then a cache hit: one version
        execute_stage("9A", _gates(512), inputs, ctx)
    (v1,) = client.search_model_versions(f"name = '{name}'")
    assert client.get_model_version_by_alias(name, "champion").version == v1.version
    judged = next(p for p in (workspace / "store" / "9A").iterdir() if not p.name.startswith("."))
    digest = load_bundle(judged / "bundle").digest
    assert v1.tags[f"{TAG}bundle_sha256"] == digest and v1.tags[f"{TAG}release"] == "releasable"
    assert v1.tags[f"{TAG}prefect_flow_run_id"] == "prefect-run-1" and v1.tags[f"{TAG}git_sha"] == "abc123"
    assert json.loads(v1.tags[f"{TAG}source_runs"])["9"] == evaluation_run

    with pytest.raises(KibidangoError, match="quality gates failed"):  # published, not releasable
        execute_stage("9A", _gates(50), inputs, ctx)
    versions = sorted(client.search_model_versions(f"name = '{name}'"), key=lambda v: int(v.version))
    assert [v.tags[f"{TAG}release"] for v in versions] == ["releasable", "not releasable"]
    assert versions[1].tags[f"{TAG}gates_failed"] == "gold-answer-perplexity"
    assert client.get_model_version_by_alias(name, "champion").version == v1.version  # did not move

    table = versions_table(client, "test", ["gsm8k/auto/accuracy"])
    assert "champion" in table and "not releasable" in table and "0.2500" in table

    # the runtime, as a user runs it: the tracking URI in the environment, a models:/ URI as the bundle
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri())
    import mlflow

    mlflow.set_tracking_uri(tracking_uri())  # an earlier test's process-wide URI would win over the environment
    cache = workspace / "runtime-cache"
    monkeypatch.setenv("KIBIDANGO_CACHE", str(cache))
    uri = f"models:/{name}@champion"
    loaded = load_bundle(uri)
    assert loaded.digest == digest and loaded.manifest.release.releasable is True
    assert loaded.root == cache / "registry" / name / str(v1.version)
    assert Pipeline.from_bundle(uri).generate("Once upon a time", max_new_tokens=4).token_ids
    assert load_bundle(f"models:/{name}/2").manifest.release.releasable is False

    # a cached download altered on disk is refused by the bundle's own hashes
    weights = loaded.root / "tiers" / "target" / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")
    with pytest.raises(BundleError, match="does not match its sha256"):
        load_bundle(uri)
    # a tampered copy in MLflow's artifact store: the download is refused, by file or by manifest
    shutil.rmtree(cache)
    source = client.get_model_version_by_alias(name, "champion").source.removeprefix("file://")
    stored = next(p for p in (workspace / "mlartifacts").rglob("model.safetensors") if str(p).startswith(source))
    stored.write_bytes(stored.read_bytes()[:-1] + b"\0")
    with pytest.raises(BundleError, match="does not match its sha256"):
        load_bundle(uri)
    shutil.rmtree(cache)
    manifest = next(p for p in (workspace / "mlartifacts").rglob("bundle.json") if str(p).startswith(source))
    manifest.write_text(manifest.read_text().replace('"mode": "ar"', '"mode": "sd"'))
    with pytest.raises(BundleError, match="was registered with"):
        load_bundle(uri)
    with pytest.raises(BundleError, match="not a registered bundle"):
        load_bundle("models:/no slash/or@alias/3")
    with pytest.raises(BundleError, match="not found|does not exist|RESOURCE_DOES_NOT_EXIST|Registered Model"):
        load_bundle("models:/kibidango-nope@champion")

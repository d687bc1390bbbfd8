"""``make eval-harness``: lm-evaluation-harness drives ``kibidango serve`` (a real server on
127.0.0.1, with a key) through its ``local-chat-completions`` model on a handful of GSM8K tasks of a
stage-9 artifact, from a local task definition (no hub); its per-task verdicts line up with stage 9's
on the same ids, and the run is recorded beside stage 9's in MLflow."""

from __future__ import annotations

import json

import pytest

from eval.shared_data import SHARED

STORIES = SHARED / "models" / "stories260K" / "hf"
GSM8K = SHARED / "data" / "gsm8k" / "test.jsonl"


def test_lm_eval_drives_the_served_bundle_on_stage_9s_gsm8k_ids(workspace):
    pytest.importorskip("lm_eval", reason="needs lm-eval (make setup)")
    if not (STORIES / "model.safetensors").is_file() or not GSM8K.is_file():
        pytest.skip(f"needs stories260K and GSM8K under {SHARED}")
    from core.store import ArtifactStore
    from eval.harness import main
    from flows.tracking import Tracker
    from kibidango import write_bundle
    from methods.benchmarks import load_tasks

    store = ArtifactStore(workspace / "store")
    staging = store.new_staging_dir("X", "kx")
    write_bundle(staging / "bundle", {"target": {"hf": STORIES, "vocab_size": 512}}, {"mode": "ar", "stop_ids": [2]})
    store.publish("X", "kx", staging, {"metrics": {}})
    tasks = load_tasks("gsm8k", GSM8K, "evaluation")[:3]
    tracker = Tracker("exp-harness")
    stage9_run = tracker.start_run("9-evaluate", {})
    tracker.end_run(stage9_run, ok=True)
    staging = store.new_staging_dir("9", "k9")
    rows = [  # stage 9's verdicts as it records them: the story model writes no number; one is marked passed
        {"id": t.id, "sample": "gsm8k", "answers": {"auto": {"text": "", "passed": i == 0}}}
        for i, t in enumerate(tasks)
    ]
    (staging / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {"samples": [{"name": "gsm8k", "source": "gsm8k", "path": str(GSM8K), "size": 3}], "max_new_tokens": 8}
    evaluation = store.publish(
        "9", "k9", staging, {"config": config, "inputs": {"bundle": {"key": "kx"}}, "mlflow_run_id": stage9_run}
    )

    assert main(["--evaluation", evaluation.path]) == 0
    report = json.loads((workspace / "reports" / "eval-harness-tiny.json").read_text())
    f = report["figures"]
    assert f["n"] == 3 and f["stage9"]["accuracy"] == pytest.approx(1 / 3)
    assert f["flexible-extract"]["accuracy"] == 0.0 and f["only_stage9"] == 1 and f["agree"] == 2
    assert [t["id"] for t in report["tasks"]] == [t.id for t in tasks]
    assert all(isinstance(t["harness"]["answer"], str) for t in report["tasks"])  # what the server answered
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{workspace / 'mlflow.db'}")  # not mlflow's process-wide URI: other tests
    experiment = client.get_experiment_by_name("exp-harness").experiment_id
    (run,) = client.search_runs([experiment], "tags.`kibidango.measurement` = 'eval-harness'")
    assert run.data.tags["kibidango.stage9_run_id"] == stage9_run and run.data.metrics["gsm8k/stage9/accuracy"] > 0

"""Stages on a Prefect work pool, for real: a Prefect server, a worker started as ``make worker``
starts it (its own workspace, as on another machine), an S3-compatible object store as the shared
artifact store and an MLflow server, all on 127.0.0.1. The tiny chain stage 0 -> P runs with P
(tagged gpu) routed to the pool: P trains on the worker (real axolotl), its artifact reaches the
flow through the shared store, and its MLflow run hangs under the flow's parent run. A second run
from fresh workspaces, the flow's and the worker's, is all cache hits from the shared store."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from core.store import ArtifactStore
from flows.tracking import TAG
from methods.local_server import stop_process
from tests.conftest import REPO, cli_env
from tests.test_training_resume import _needs_axolotl_and_shared
from tests.test_training_resume import _preset as _chain

POOL = "kibidango-test-pool"


def _env(home: Path, s3, mlflow_server: str, prefect_server: str, url: str) -> dict[str, str]:
    return {
        **cli_env(home),
        **s3.env,
        "KIBIDANGO_STORE_URL": url,
        "MLFLOW_TRACKING_URI": mlflow_server,
        "PREFECT_API_URL": prefect_server,
        "PREFECT_WORKER_QUERY_SECONDS": "2",
    }


def _worker(home: Path, env: dict, log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flows", "worker", "--pool", POOL],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 180
    while "starting a worker" not in log.read_text(errors="replace"):  # deployed; the worker polls next
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
        time.sleep(0.5)
    return proc


def test_a_stage_runs_on_a_work_pool_through_the_shared_store(s3, mlflow_server, prefect_server, tmp_path):
    _needs_axolotl_and_shared()
    preset = _chain(tmp_path)
    spec = yaml.safe_load(preset.read_text())
    spec["stages"]["P"]["config"]["tiers"]["target"]["train"] |= {"max_steps": 6, "save_steps": 3}
    spec["pools"] = {"gpu": POOL}  # P is tagged gpu
    preset.write_text(yaml.safe_dump(spec))
    url = f"s3://{s3.bucket}/pools-{tmp_path.name}"

    def flow(home: Path) -> subprocess.CompletedProcess:
        env = _env(home, s3, mlflow_server, prefect_server, url)
        return subprocess.run(
            [sys.executable, "-m", "flows", "run", "--preset", str(preset)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )

    worker_home = tmp_path / "worker"
    log = tmp_path / "worker.log"
    worker = _worker(worker_home, _env(worker_home, s3, mlflow_server, prefect_server, url), log)
    try:
        first = flow(tmp_path / "flow-a")
        assert first.returncode == 0, first.stderr[-3000:] + log.read_text(errors="replace")[-3000:]
        worker_text = log.read_text(errors="replace")
        assert "stage P (pretrain): running (no cached artifact)" in worker_text
        assert "stage 0 (curate)" not in worker_text  # stage 0 is not routed: it ran in the flow,
        assert f"pulled from {url}/0/" in worker_text  # and reached the worker through the shared store
        assert "stage 0 (curate): running" in first.stderr and f"pulled from {url}/P/" in first.stderr
        (on_worker,) = ArtifactStore(worker_home / "store").artifacts("P")
        (in_flow,) = ArtifactStore(tmp_path / "flow-a" / "store").artifacts("P")
        digest = json.loads((on_worker / "manifest.json").read_text())["digest"]
        assert json.loads((in_flow / "manifest.json").read_text())["digest"] == digest
        assert (in_flow / "target" / "model.safetensors").is_file()

        from mlflow import MlflowClient

        client = MlflowClient(mlflow_server)
        exp = client.get_experiment_by_name("kibidango-resumetest")
        (p_run,) = client.search_runs([exp.experiment_id], f"tags.`{TAG}stage_id` = 'P'")
        (stage0_run,) = client.search_runs([exp.experiment_id], f"tags.`{TAG}stage_id` = '0'")
        assert p_run.data.tags["mlflow.parentRunId"] == stage0_run.data.tags["mlflow.parentRunId"]  # one flow run
        assert p_run.data.tags[f"{TAG}cached"] == "no" and p_run.data.metrics  # trained and tracked on the worker

        # another machine for the flow and a fresh worker: everything comes from the shared store
        stop_process(worker)
        shutil.rmtree(worker_home)
        worker = _worker(worker_home, _env(worker_home, s3, mlflow_server, prefect_server, url), log)
        second = flow(tmp_path / "flow-b")
        assert second.returncode == 0, second.stderr[-3000:]
        worker_text = log.read_text(errors="replace")
        assert "running (" not in second.stderr and "running (" not in worker_text
        assert f"pulled from {url}/P/" in worker_text and f"pulled from {url}/0/" in second.stderr
        runs = client.search_runs(
            [exp.experiment_id], f"tags.`{TAG}stage_id` = 'P'", order_by=["attributes.start_time ASC"]
        )
        assert [r.data.tags[f"{TAG}cached"] for r in runs] == ["no", "yes"]
        assert runs[1].data.tags[f"{TAG}source_run_id"] == runs[0].info.run_id  # the hit names the run that computed it
        logged = {f.path for f in client.list_artifacts(runs[0].info.run_id)}
        assert "manifest.json" in logged  # logged through the tracking server's artifact root
        assert not (tmp_path / "flow-a" / "mlflow.db").exists()  # tracked by the server, not a local file
    finally:
        stop_process(worker)

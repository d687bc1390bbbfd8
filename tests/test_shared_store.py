"""The shared artifact store and tracking: artifacts pushed to an S3-compatible object store (a real
``moto_server`` on 127.0.0.1, through s3fs) and pulled, hash-checked, by another machine's
workspace; runs tracked in a real ``mlflow server`` (SQL backend, artifact root). A second
machine's flow run is all cache hits from the shared store; a damaged object is never used."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from core.remote import RemoteStore
from core.store import ArtifactStore
from flows.tracking import TAG
from methods.serving import free_port
from tests.conftest import REPO, cli_env, write_jsonl
from tests.test_flow import _preset

BUCKET = "kibidango-test"


def _wait(url: str, proc: subprocess.Popen, what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"{what} did not answer {url} in {timeout_s:.0f}s")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on loopback and the environment that points s3fs at it."""
    exe = Path(sys.executable).with_name("moto_server")
    if not exe.is_file():
        pytest.skip("moto_server is not installed (pip install 'moto[server]'; make setup does)")
    port = free_port()
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        _wait(f"http://127.0.0.1:{port}/", proc, "moto_server", 60)
        env = {
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test-secret",
            "AWS_DEFAULT_REGION": "us-east-1",
            "KIBIDANGO_STORE_OPTIONS": json.dumps({"endpoint_url": f"http://127.0.0.1:{port}"}),
        }
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        RemoteStore(f"s3://{BUCKET}", {"endpoint_url": f"http://127.0.0.1:{port}"}).fs.mkdir(BUCKET)
        yield env
    finally:
        for k, v in locals().get("old", {}).items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _stop(proc)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    exe = Path(sys.executable).with_name("mlflow")
    cmd = [str(exe), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", (root / "art").as_uri()]  # fmt: skip
    with open(root / "server.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait(f"http://127.0.0.1:{port}/health", proc, "mlflow server", 180)
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop(proc)


def _remote(s3, prefix: str) -> RemoteStore:
    return RemoteStore(f"s3://{BUCKET}/{prefix}", json.loads(s3["KIBIDANGO_STORE_OPTIONS"]))


def _publish(store: ArtifactStore, tmp_path: Path, text: str):
    staging = store.new_staging_dir("0", "k1")
    (staging / "data").mkdir()
    (staging / "data" / "rows.txt").write_text(text)
    return store.publish("0", "k1", staging, {"metrics": {"rows": 1.0}})


def test_an_artifact_pushed_by_one_machine_is_pulled_checked_by_another(s3, tmp_path, caplog):
    a = ArtifactStore(tmp_path / "a", _remote(s3, "unit"))
    published = _publish(a, tmp_path, "hello")
    b = ArtifactStore(tmp_path / "b", _remote(s3, "unit"))  # another machine: nothing local
    pulled = b.get("0", "k1")
    assert pulled is not None and pulled.digest == published.digest
    assert (Path(pulled.path) / "data" / "rows.txt").read_text() == "hello"
    assert b.verify(Path(pulled.path), full=True) is None and b.get("0", "k1").path == pulled.path
    assert ArtifactStore(tmp_path / "c").get("0", "k1") is None  # no shared store: a miss

    # a damaged object (same size) is never used: a miss with a warning naming it
    fs = _remote(s3, "unit").fs
    fs.pipe_file(f"{BUCKET}/unit/0/k1/data/rows.txt", b"hellO")
    d = ArtifactStore(tmp_path / "d", _remote(s3, "unit"))
    assert d.get("0", "k1") is None
    assert f"s3://{BUCKET}/unit/0/k1: data/rows.txt does not match its size and sha256" in caplog.text
    assert not list((tmp_path / "d").rglob("rows.txt"))  # nothing half-installed

    # a forced rerun republishes; the other machine's damaged-local copy is replaced from the store
    republished = _publish(a, tmp_path, "hello again")
    (Path(pulled.path) / "data" / "rows.txt").write_text("hellx")  # b's local copy damaged
    again = b.get("0", "k1")
    assert again is not None and again.digest == republished.digest
    assert (Path(again.path) / "data" / "rows.txt").read_text() == "hello again"


def test_a_second_machine_runs_the_flow_from_the_shared_store(s3, mlflow_server, tmp_path):
    rows = [{"instruction": f"Name colour {i}.", "output": f"Colour {i} is a shade of teal."} for i in range(40)]
    preset = _preset(tmp_path, write_jsonl(tmp_path / "src.jsonl", rows))
    url = f"s3://{BUCKET}/flow-{tmp_path.name}"

    def run(home: Path) -> subprocess.CompletedProcess:
        env = {**cli_env(home), **s3, "KIBIDANGO_STORE_URL": url, "MLFLOW_TRACKING_URI": mlflow_server}
        return subprocess.run([sys.executable, "-m", "flows", "run", "--preset", str(preset)], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=600)  # fmt: skip

    first = run(tmp_path / "machine-a")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "running (no cached artifact)" in first.stderr and f"pushed to {url}/0/" in first.stderr
    second = run(tmp_path / "machine-b")  # a fresh workspace: nothing local
    assert second.returncode == 0, second.stderr[-3000:]
    assert "running (" not in second.stderr and f"pulled from {url}/0/" in second.stderr
    (a,) = ArtifactStore(tmp_path / "machine-a" / "store").artifacts("0")
    (b,) = ArtifactStore(tmp_path / "machine-b" / "store").artifacts("0")
    assert (
        json.loads((a / "manifest.json").read_text())["digest"]
        == json.loads((b / "manifest.json").read_text())["digest"]
    )
    assert not (tmp_path / "machine-a" / "mlflow.db").exists()  # tracked by the server, not a local file

    from mlflow import MlflowClient

    client = MlflowClient(mlflow_server)
    exp = client.get_experiment_by_name("kibidango-flowtest")
    runs = client.search_runs(
        [exp.experiment_id], f"tags.`{TAG}stage_id` = '0'", order_by=["attributes.start_time ASC"]
    )
    assert [r.data.tags[f"{TAG}cached"] for r in runs][-2:] == ["no", "yes"]
    computed = runs[-2]
    assert runs[-1].data.tags[f"{TAG}source_run_id"] == computed.info.run_id
    logged = {f.path for f in client.list_artifacts(computed.info.run_id)}
    assert "manifest.json" in logged and "data_card.md" in logged  # through the server's artifact root
    shutil.rmtree(tmp_path / "machine-a", ignore_errors=True)

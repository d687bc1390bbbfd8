"""The shared artifact store and tracking: artifacts pushed to an S3-compatible object store (a real
``moto_server`` on 127.0.0.1, through s3fs) and pulled, hash-checked, by another machine's
workspace; runs tracked in a real ``mlflow server`` (SQL backend, artifact root). A second
machine's flow run is all cache hits from the shared store; a damaged object is never used."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from core.remote import RemoteStore
from core.store import ArtifactStore
from flows.tracking import TAG
from tests.conftest import REPO, cli_env, write_jsonl
from tests.test_flow import _preset


def _remote(s3, prefix: str) -> RemoteStore:
    return RemoteStore(f"s3://{s3.bucket}/{prefix}", s3.options)


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
    prefix = json.loads(fs.cat_file(f"{s3.bucket}/unit/0/k1/manifest.json"))["prefix"]  # this publication's files
    fs.pipe_file(f"{s3.bucket}/unit/0/k1/{prefix}/data/rows.txt", b"hellO")
    d = ArtifactStore(tmp_path / "d", _remote(s3, "unit"))
    assert d.get("0", "k1") is None
    assert f"s3://{s3.bucket}/unit/0/k1: data/rows.txt does not match its size and sha256" in caplog.text
    assert not list((tmp_path / "d").rglob("rows.txt"))  # nothing half-installed

    # a forced rerun republishes; the other machine's damaged-local copy is replaced from the store
    republished = _publish(a, tmp_path, "hello again")
    (Path(pulled.path) / "data" / "rows.txt").write_text("hellx")  # b's local copy damaged
    again = b.get("0", "k1")
    assert again is not None and again.digest == republished.digest
    assert (Path(again.path) / "data" / "rows.txt").read_text() == "hello again"


def test_a_forged_digest_or_a_colliding_file_list_is_a_miss_never_a_hit_or_a_crash(s3, tmp_path, caplog):
    a = ArtifactStore(tmp_path / "a", _remote(s3, "forged"))
    published = _publish(a, tmp_path, "hello")
    fs = _remote(s3, "forged").fs
    path = f"{s3.bucket}/forged/0/k1/manifest.json"
    manifest = json.loads(fs.cat_file(path))
    fs.pipe_file(path, json.dumps({**manifest, "digest": "0" * 24}).encode())  # the files are intact
    assert ArtifactStore(tmp_path / "b", _remote(s3, "forged")).get("0", "k1") is None
    assert "manifest.json's digest is not the digest of its files" in caplog.text
    # a file `data` and a file `data/rows.txt`: one name as a file and as a directory
    entry = manifest["files"][0]
    fs.pipe_file(f"{s3.bucket}/forged/0/k1/{manifest['prefix']}/data", b"x")
    both = {**manifest, "files": [{**entry, "path": "data", "size": 1}, entry]}
    fs.pipe_file(path, json.dumps(both).encode())
    assert ArtifactStore(tmp_path / "c", _remote(s3, "forged")).get("0", "k1") is None
    assert "lists 'data' as a file and 'data/rows.txt' inside it" in caplog.text
    fs.pipe_file(path, json.dumps({**manifest, "prefix": "../../elsewhere"}).encode())
    assert ArtifactStore(tmp_path / "d", _remote(s3, "forged")).get("0", "k1") is None
    assert "malformed prefix" in caplog.text
    fs.pipe_file(path, json.dumps(manifest).encode())  # restored: a hit again, with the files' own digest
    assert ArtifactStore(tmp_path / "e", _remote(s3, "forged")).get("0", "k1").digest == published.digest


def test_two_machines_publishing_one_key_at_once_never_damage_it(s3, tmp_path):
    """Ten rounds of two publishers racing on one key (a forced rerun on two workers): after each,
    a third machine pulls an intact artifact, one publisher's or the other's, never a mix."""
    import threading

    contents = set()
    for round_ in range(10):
        texts = [f"round {round_} from a " + "a" * 5000, f"round {round_} from b " + "b" * 7000]
        contents.update(texts)
        stores = [ArtifactStore(tmp_path / f"r{round_}-{m}", _remote(s3, "race")) for m in "ab"]
        barrier = threading.Barrier(2)

        def publish(store, text, barrier=barrier):
            staging = store.new_staging_dir("0", "k1")
            (staging / "data").mkdir()
            for n in range(8):  # several files: a mix would show
                (staging / "data" / f"part{n}.txt").write_text(text)
            barrier.wait()
            store.publish("0", "k1", staging, {"metrics": {}})

        threads = [threading.Thread(target=publish, args=(s, t)) for s, t in zip(stores, texts, strict=True)]
        [t.start() for t in threads]
        [t.join(120) for t in threads]
        reader = ArtifactStore(tmp_path / f"r{round_}-reader", _remote(s3, "race"))
        got = reader.get("0", "k1")
        assert got is not None, f"round {round_}: the shared copy is damaged"
        parts = {(Path(got.path) / "data" / f"part{n}.txt").read_text() for n in range(8)}
        assert len(parts) == 1 and parts <= set(texts), f"round {round_}: a mix of two publications"


# ~100 s; behind the slow marker to keep `make test` in CI's time: tests/test_work_pools.py runs the
# same two-machine flow through the shared store and the MLflow server (with a worker besides).
@pytest.mark.slow
@pytest.mark.slow  # ~100 s; tests/test_work_pools.py runs the same second-machine flow (and a worker) in `make test`
def test_a_second_machine_runs_the_flow_from_the_shared_store(s3, mlflow_server, tmp_path):
    rows = [{"instruction": f"Name colour {i}.", "output": f"Colour {i} is a shade of teal."} for i in range(40)]
    preset = _preset(tmp_path, write_jsonl(tmp_path / "src.jsonl", rows))
    url = f"s3://{s3.bucket}/flow-{tmp_path.name}"

    def run(home: Path) -> subprocess.CompletedProcess:
        env = {**cli_env(home), **s3.env, "KIBIDANGO_STORE_URL": url, "MLFLOW_TRACKING_URI": mlflow_server}
        return subprocess.run(
            [sys.executable, "-m", "flows", "run", "--preset", str(preset)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )

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


def test_sync_takes_the_shared_stores_newer_publication(s3, tmp_path):
    """A stage forced on a worker republishes a key this machine already holds: ``get`` keeps the
    intact local copy, ``sync`` (what a pool-routed stage's result is read with) takes the new one."""
    a = ArtifactStore(tmp_path / "a", _remote(s3, "sync"))
    b = ArtifactStore(tmp_path / "b", _remote(s3, "sync"))
    _publish(a, tmp_path, "first")
    assert (Path(b.get("0", "k1").path) / "data" / "rows.txt").read_text() == "first"
    newer = _publish(a, tmp_path, "second")
    assert (Path(b.get("0", "k1").path) / "data" / "rows.txt").read_text() == "first"
    synced = b.sync("0", "k1")
    assert synced.digest == newer.digest and (Path(synced.path) / "data" / "rows.txt").read_text() == "second"
    assert b.sync("0", "k1").path == synced.path  # in step: nothing to pull


def test_a_local_hit_the_shared_store_lacks_is_pushed(s3, tmp_path):
    """An artifact published while the shared store was not configured (or unreachable) reaches it
    at its next lookup, so other machines find it."""
    alone = ArtifactStore(tmp_path / "a")
    published = _publish(alone, tmp_path, "offline")
    shared = ArtifactStore(tmp_path / "a", _remote(s3, "heal"))
    assert shared.get("0", "k1").digest == published.digest
    other = ArtifactStore(tmp_path / "b", _remote(s3, "heal"))
    assert other.get("0", "k1").digest == published.digest

"""Cache keys and the artifact store: atomic publish, partial artifacts never read."""

from __future__ import annotations

import importlib
import json
import os
import sys

from core.contract import code_version
from core.store import MANIFEST, ArtifactStore, cache_key
from stages import load_stage


def test_cache_key_changes_with_config_input_and_code():
    base = cache_key("0", "code-a", {"threshold": 0.5, "seed": 1}, {"source:x": "d1"})
    assert cache_key("0", "code-a", {"seed": 1, "threshold": 0.5}, {"source:x": "d1"}) == base  # canonical JSON
    assert cache_key("0", "code-a", {"threshold": 0.6, "seed": 1}, {"source:x": "d1"}) != base  # config
    assert cache_key("0", "code-a", {"threshold": 0.5, "seed": 1}, {"source:x": "d2"}) != base  # input digest
    assert cache_key("0", "code-b", {"threshold": 0.5, "seed": 1}, {"source:x": "d1"}) != base  # code version
    assert cache_key("1A", "code-a", {"threshold": 0.5, "seed": 1}, {"source:x": "d1"}) != base  # stage id


def test_code_version_changes_with_the_stage_code_not_its_comments(tmp_path, monkeypatch):
    module_file = tmp_path / "kb_fake_stage.py"
    module_file.write_text("NAME = 'fake'\n\ndef run(cfg, inputs, out_dir):\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("kb_fake_stage")
    before = code_version(module)
    commented = module_file.read_text() + "\n# a comment is not behaviour\n"
    assert code_version(module, sources={"kb_fake_stage": commented}) == before
    changed = module_file.read_text().replace("return 1", "return 2")
    assert code_version(module, sources={"kb_fake_stage": changed}) != before
    sys.modules.pop("kb_fake_stage", None)


def test_code_version_covers_the_helpers_a_stage_uses_and_nothing_else():
    from core.codehash import definitions
    from core.contract import PLUMBING, PROJECT_PACKAGES

    reached = {module for module, _ in definitions(load_stage("0"), PROJECT_PACKAGES, PLUMBING)}
    assert {"stages.curate", "methods.curation.dedup", "methods.curation.ingest", "methods.curation.example"} <= reached
    assert not any(name.startswith("flows") or name in PLUMBING for name in reached)


def _stage_files(store: ArtifactStore, key: str, text: str = "hello"):
    staging = store.new_staging_dir("0", key)
    (staging / "data").mkdir()
    (staging / "data" / "rows.txt").write_text(text)
    return staging


def test_publish_writes_manifest_and_is_found(tmp_path):
    store = ArtifactStore(tmp_path)
    staging = _stage_files(store, "k1")
    assert store.get("0", "k1") is None  # a staging dir is never a hit
    artifact = store.publish("0", "k1", staging, {"mlflow_run_id": "r1"})
    assert not staging.exists()
    manifest = json.loads((tmp_path / "0" / "k1" / MANIFEST).read_text())
    assert manifest["key"] == "k1" and manifest["mlflow_run_id"] == "r1"
    assert [{k: v for k, v in f.items() if k != "mtime_ns"} for f in manifest["files"]] == [
        {
            "path": "data/rows.txt",
            "size": 5,
            "sha256": "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824",
        }
    ]
    assert store.get("0", "k1") == artifact
    # The digest is the content's: same bytes under another key, another run id -> same digest.
    other = store.publish("0", "k2", _stage_files(store, "k2"), {"mlflow_run_id": "r2"})
    assert other.digest == artifact.digest
    changed = store.publish("0", "k3", _stage_files(store, "k3", "hello!"), {})
    assert changed.digest != artifact.digest


def test_partial_or_damaged_artifacts_are_never_read(tmp_path):
    store = ArtifactStore(tmp_path)
    # A directory at the final path without a manifest (e.g. copied by hand, half-written).
    (tmp_path / "0" / "nomanifest").mkdir(parents=True)
    (tmp_path / "0" / "nomanifest" / "rows.txt").write_text("x")
    assert store.get("0", "nomanifest") is None
    # A published artifact whose file was truncated afterwards.
    store.publish("0", "k1", _stage_files(store, "k1"), {})
    (tmp_path / "0" / "k1" / "data" / "rows.txt").write_text("he")
    assert store.get("0", "k1") is None
    # A corrupt manifest.
    store.publish("0", "k2", _stage_files(store, "k2"), {})
    (tmp_path / "0" / "k2" / MANIFEST).write_text("{not json")
    assert store.get("0", "k2") is None


def test_a_same_size_change_is_a_miss_and_full_verification_catches_a_restored_mtime(tmp_path, caplog):
    store = ArtifactStore(tmp_path)
    store.publish("0", "k1", _stage_files(store, "k1"), {})
    rows = tmp_path / "0" / "k1" / "data" / "rows.txt"
    before = rows.stat()
    rows.write_text("HELLO")  # same size, other bytes (what the probe did to an arrow file)
    with caplog.at_level("WARNING", logger="kibidango.store"):
        assert store.get("0", "k1") is None
    assert f"{tmp_path / '0' / 'k1'}: data/rows.txt does not match its sha256" in caplog.text
    os.utime(rows, ns=(before.st_atime_ns, before.st_mtime_ns))  # mtime put back: the cheap check passes
    assert store.get("0", "k1") is not None
    assert "does not match its sha256" in store.verify(tmp_path / "0" / "k1", full=True)


def test_an_unreadable_manifest_is_a_miss_with_a_warning_naming_the_directory(tmp_path, caplog):
    store = ArtifactStore(tmp_path)
    for text in (
        "{}",
        "[]",
        "{not json",
        '{"digest": "x", "files": [{"path": "../../etc/passwd", "size": 1, "sha256": "y"}]}',
        "[" * 100_000,
    ):
        store.publish("0", "k1", _stage_files(store, "k1"), {})
        (tmp_path / "0" / "k1" / MANIFEST).write_text(text)
        caplog.clear()
        with caplog.at_level("WARNING", logger="kibidango.store"):
            assert store.get("0", "k1") is None
        assert str(tmp_path / "0" / "k1") in caplog.text and "recomputes" in caplog.text
    store.publish("0", "k1", _stage_files(store, "k1"), {})  # the recomputed artifact replaces it
    assert store.get("0", "k1") is not None


def test_leftovers_of_dead_processes_are_swept(tmp_path):
    store = ArtifactStore(tmp_path)
    dead = tmp_path / "0" / ".tmp-k1-999999999-deadbeef"  # no such pid
    dead.mkdir(parents=True)
    (dead / "half.bin").write_bytes(b"\0" * 10)
    alive = tmp_path / "0" / f".tmp-k2-{os.getppid()}-cafebabe"  # a live process (our parent)
    alive.mkdir()
    assert list(store.leftovers()) == [dead]
    store.new_staging_dir("0", "k3")
    assert not dead.exists() and alive.exists()


def test_forced_republish_replaces_the_artifact(tmp_path):
    store = ArtifactStore(tmp_path)
    store.publish("0", "k1", _stage_files(store, "k1", "old"), {"mlflow_run_id": "r1"})
    again = store.publish("0", "k1", _stage_files(store, "k1", "new"), {"mlflow_run_id": "r2"})
    assert (tmp_path / "0" / "k1" / "data" / "rows.txt").read_text() == "new"
    assert again.manifest["mlflow_run_id"] == "r2"
    assert [p.name for p in (tmp_path / "0").iterdir()] == ["k1"]  # nothing left aside


def test_a_retrain_whose_outputs_repeat_keeps_its_digest_whatever_its_log_says(tmp_path, caplog):
    """A forced rerun of a training stage repeats its weights byte for byte (seeded) but never its
    logs/train.log (tokens/s, wall times): the log is listed and verified, not part of the digest,
    so every stage after it stays cached. A store written before (schema 1) keeps its digests."""
    from core.store import content_digest

    store = ArtifactStore(tmp_path)

    def trained(key: str, log: str, weights: str = "w"):
        staging = _stage_files(store, key, weights)
        (staging / "logs").mkdir()
        (staging / "logs" / "train.log").write_text(log)
        return staging

    first = store.publish("0", "k1", trained("k1", "12.3 tokens/s"), {})
    forced = store.publish("0", "k1", trained("k1", "11.9 tokens/s"), {})
    assert forced.digest == first.digest and [f["path"] for f in forced.manifest["files"]] == [
        "data/rows.txt",
        "logs/train.log",
    ]
    assert store.publish("0", "k2", trained("k2", "12.3 tokens/s", "w2"), {}).digest != first.digest
    # still verified: an edited log is a damaged artifact, a miss
    log = tmp_path / "0" / "k1" / "logs" / "train.log"
    log.write_text("edited!!!!!!!")
    assert store.get("0", "k1") is None and "not used as a cache hit" in caplog.text
    # a schema-1 manifest digests every file, the log included, and stays a hit as written
    old = store.publish("0", "k3", trained("k3", "9.0 tokens/s"), {})
    path = tmp_path / "0" / "k3" / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["schema"], manifest["digest"] = 1, content_digest(manifest["files"], schema=1)
    assert manifest["digest"] != old.digest
    path.write_text(json.dumps(manifest))
    assert store.get("0", "k3").digest == manifest["digest"]
    manifest["schema"] = 7  # written by a newer kibidango: not read as a hit
    path.write_text(json.dumps(manifest))
    assert store.get("0", "k3") is None and "schema 7" in caplog.text

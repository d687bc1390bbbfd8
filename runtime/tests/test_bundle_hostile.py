"""Malicious bundles and packs, built in a temp dir: nothing is written or read outside their
root, every loaded file is listed and hashed, an edited manifest is caught, and a pinned digest
refuses a bundle whose hashes were all rewritten by whoever rewrote its files."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kibidango import BundleError, load_bundle, write_bundle
from kibidango.bundle.pack import pack_bundle, unpack_bundle
from tests.conftest import STORIES, needs_stories


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    needs_stories()
    root = tmp_path_factory.mktemp("hostile")
    return write_bundle(root / "bundle", {"target": {"hf": STORIES, "vocab_size": 512}}, {"mode": "ar"}, preset="test")


def _copy(clean: Path, tmp_path: Path) -> Path:
    return shutil.copytree(clean, tmp_path / "work" / "bundle")


def _rewrite(bundle: Path, edit, resign: bool = True) -> None:
    """Edit bundle.json as an attacker would; with ``resign`` the sidecar digest is rewritten too."""
    meta = json.loads((bundle / "bundle.json").read_text())
    edit(meta)
    text = json.dumps(meta).encode()
    (bundle / "bundle.json").write_bytes(text)
    if resign:
        (bundle / "bundle.json.sha256").write_text(f"{hashlib.sha256(text).hexdigest()}  bundle.json\n")


def _entry(path: str, data: bytes) -> dict:
    return {"path": path, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _tree(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


@pytest.mark.parametrize("evil", ["../../escaped.txt", "../escaped.txt", "ok/../../../escaped.txt"])
def test_pack_paths_with_dotdot_write_nothing_outside(clean, tmp_path, evil):
    packed = tmp_path / "area" / "packed"
    pack_bundle(clean, packed, dict_size=4096)
    meta = json.loads((packed / "pack.json").read_text())
    meta["files"][0]["path"] = evil
    (packed / "pack.json").write_text(json.dumps(meta))
    before = _tree(tmp_path)
    with pytest.raises(BundleError, match="points outside the bundle"):
        unpack_bundle(packed, tmp_path / "area" / "cache" / "out")
    assert _tree(tmp_path) == before  # not one file or directory created anywhere


def test_pack_absolute_paths_and_symlinks_are_refused(clean, tmp_path, monkeypatch):
    monkeypatch.setenv("KIBIDANGO_CACHE", str(tmp_path / "cache"))
    packed = tmp_path / "packed"
    pack_bundle(clean, packed, dict_size=4096)
    original = (packed / "pack.json").read_text()
    target = tmp_path / "victim.txt"
    for field, value, message in (
        ("path", str(target), "points outside"),
        ("packed", "/etc/hostname", "points outside"),
        ("packed", "files/../../secret.zst", "points outside"),
    ):
        meta = json.loads(original)
        meta["files"][0][field] = value
        (packed / "pack.json").write_text(json.dumps(meta))
        with pytest.raises(BundleError, match=message):
            load_bundle(packed)
        assert not target.exists()
    (tmp_path / "outside.zst").write_bytes(b"x")
    meta = json.loads(original)
    os.symlink(tmp_path / "outside.zst", packed / "files" / "link.zst")
    meta["files"][0]["packed"] = "files/link.zst"
    (packed / "pack.json").write_text(json.dumps(meta))
    with pytest.raises(BundleError, match="resolves outside"):
        load_bundle(packed)
    meta = json.loads(original)
    meta["dictionary"] = "../dictionary.zstd"
    (packed / "pack.json").write_text(json.dumps(meta))
    with pytest.raises(BundleError, match="dictionary"):
        load_bundle(packed)


def test_bundle_file_entries_outside_the_root_are_refused_without_reading_them(clean, tmp_path):
    bundle = _copy(clean, tmp_path)
    secret = tmp_path / "work" / "secret.txt"
    secret.write_bytes(b"not yours")
    for evil in ("../secret.txt", str(secret), str(tmp_path / "does-not-exist")):
        _rewrite(bundle, lambda m, e=evil: m["files"].append(_entry(e, b"not yours")))
        with pytest.raises(BundleError, match=r"points outside the bundle .*: refused") as err:
            load_bundle(bundle)
        assert "missing" not in str(err.value)  # an absolute path says nothing of whether the file exists
        _rewrite(bundle, lambda m: m["files"].pop())


def test_tier_paths_must_be_inside_and_listed(clean, tmp_path):
    bundle = _copy(clean, tmp_path)
    shutil.copytree(STORIES, tmp_path / "work" / "unchecked")
    _rewrite(bundle, lambda m: m["tiers"]["target"].update(hf="../unchecked"))
    with pytest.raises(BundleError, match="tiers.target.hf: '../unchecked' points outside"):
        load_bundle(bundle)
    shutil.copytree(STORIES, bundle / "stash")  # inside the bundle, but not in the hashed list
    _rewrite(bundle, lambda m: m["tiers"]["target"].update(hf="stash"))
    with pytest.raises(BundleError, match="no file of bundle.json's files is under 'stash'"):
        load_bundle(bundle)
    _rewrite(bundle, lambda m: m["tiers"]["target"].update(hf="tiers/target/hf", gguf="stash/model.safetensors"))
    with pytest.raises(BundleError, match="tiers.target.gguf: 'stash/model.safetensors' is not in bundle.json's files"):
        load_bundle(bundle)


def test_unlisted_files_are_refused_in_weights_dirs_and_reported_elsewhere(clean, tmp_path):
    bundle = _copy(clean, tmp_path)
    (bundle / "NOTES.txt").write_text("hello")
    assert load_bundle(bundle).unlisted == ["NOTES.txt"]
    out = subprocess.run(
        [sys.executable, "-m", "kibidango", "inspect", str(bundle)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and "WARNING: NOTES.txt is not listed" in out.stdout
    (bundle / "tiers" / "target" / "hf" / "adapter_model.safetensors").write_bytes(b"\0" * 64)
    with pytest.raises(
        BundleError, match=r"tiers/target/hf/adapter_model\.safetensors is not listed .* loaded unchecked"
    ):
        load_bundle(bundle)


def test_manifest_digest_catches_edits_and_a_pin_catches_a_resigned_manifest(clean, tmp_path):
    bundle = _copy(clean, tmp_path)
    good = load_bundle(bundle).digest
    assert (bundle / "bundle.json.sha256").read_text().split()[0] == good
    _rewrite(bundle, lambda m: m["runtime_defaults"].update(temperature=1.5), resign=False)
    with pytest.raises(BundleError, match=r"bundle.json does not match bundle.json.sha256"):
        load_bundle(bundle)
    _rewrite(bundle, lambda m: m["runtime_defaults"].update(temperature=1.5))  # the attacker re-signs
    assert load_bundle(bundle).digest != good
    with pytest.raises(BundleError, match=f"but {good} was expected"):
        load_bundle(bundle, expect_sha256=good)
    out = subprocess.run(
        [sys.executable, "-m", "kibidango", "inspect", str(bundle), "--expect-sha256", good],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2 and "was expected" in out.stderr
    (bundle / "bundle.json.sha256").unlink()
    with pytest.raises(BundleError, match="no bundle.json.sha256"):
        load_bundle(bundle)
    assert load_bundle(clean, expect_sha256=f"sha256:{good}").digest == good


def test_a_packed_bundle_with_rewritten_hashes_is_refused_when_pinned(clean, tmp_path, monkeypatch):
    """The attack of the probe: a pack whose file and whose hashes were both replaced unpacks
    cleanly, but its bundle.json is not the one the pipeline built."""
    monkeypatch.setenv("KIBIDANGO_CACHE", str(tmp_path / "cache"))
    good = load_bundle(clean).digest
    evil = _copy(clean, tmp_path)
    config = evil / "tiers" / "target" / "hf" / "config.json"
    config.write_text(config.read_text().replace('"rms_norm_eps"', '"rms_norm_eps_" : 1, "rms_norm_eps"'))
    _rewrite(
        evil,
        lambda m: [
            e.update(_entry(e["path"], config.read_bytes())) for e in m["files"] if e["path"].endswith("hf/config.json")
        ],
    )
    pack_bundle(evil, tmp_path / "packed", dict_size=4096)
    assert load_bundle(tmp_path / "packed").digest != good  # every hash "verifies"
    with pytest.raises(BundleError, match="was expected"):
        load_bundle(tmp_path / "packed", expect_sha256=good)


def test_only_listed_adapters_are_loaded_from_a_bundle(clean, tmp_path):
    bundle = _copy(clean, tmp_path)
    planted = bundle / "adapters" / "code"
    (planted / "adapter").mkdir(parents=True)
    data = b'{"r": 8}'
    (planted / "adapter" / "adapter_config.json").write_bytes(data)
    entry = {"path": "adapter/adapter_config.json", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (planted / "adapter.json").write_text(json.dumps({"domain": "code", "formats": {"peft": [entry]}}))
    loaded = load_bundle(bundle)
    assert loaded.adapters.domains == []  # the planted adapter's own hashes count for nothing
    assert "adapters/code/adapter.json" in loaded.unlisted


def test_a_listed_adapter_is_loaded_and_checked(tmp_path):
    needs_stories()
    data = b'{"r": 8}'

    def add_adapter(tmp: Path) -> dict:
        (tmp / "adapters" / "code" / "adapter").mkdir(parents=True)
        (tmp / "adapters" / "code" / "adapter" / "adapter_config.json").write_bytes(data)
        entry = {"path": "adapter/adapter_config.json", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        (tmp / "adapters" / "code" / "adapter.json").write_text(
            json.dumps({"domain": "code", "formats": {"peft": [entry]}})
        )
        return {}

    root = write_bundle(
        tmp_path / "b", {"target": {"hf": STORIES, "vocab_size": 512}}, {"mode": "ar"}, finalize=add_adapter
    )
    adapters = load_bundle(root).adapters
    assert adapters.domains == ["code"]
    assert [p.name for p in adapters.get("code").files("peft")] == ["adapter_config.json"]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.update(created="2026-01-01T00:00:00Z"), r"bundle\.json: created: not a field"),
        (lambda m: m["tiers"]["target"].update(vocab_size="512"), r"tiers\.target\.vocab_size is str, expected int"),
        (lambda m: m["files"][0].update(size=True), r"files\[0\]\.size is bool, expected int"),
        (lambda m: m.update(tuned_defaults=[]), r"tuned_defaults is not an object"),
        (lambda m: m["files"][0].pop("sha256"), r"files\[0\]\.sha256 is missing"),
        (lambda m: m.update(schema_version=1), r"schema_version 1, this runtime reads 2 .*rebuild it with stage X"),
    ],
)
def test_bundle_json_is_read_through_its_schema(clean, tmp_path, edit, message):
    """Every key of bundle.json is a field of kibidango.bundle.schema.BundleManifest: an unknown key, a
    value of the wrong type or a missing one is refused naming the file and the field."""
    bundle = _copy(clean, tmp_path)
    _rewrite(bundle, edit)
    with pytest.raises(BundleError, match=message):
        load_bundle(bundle)


def test_every_schema_field_is_described_and_written_fields_round_trip(clean):
    import dataclasses

    from kibidango.bundle.schema import AdapterEntry, BundleManifest, FileEntry, Release, TierEntry, describe

    for cls in (BundleManifest, TierEntry, FileEntry, AdapterEntry, Release):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("doc"), f"{cls.__name__}.{f.name} has no description"
            assert f"`{f.name}`" in describe()
    doc = json.loads((clean / "bundle.json").read_text())
    assert BundleManifest.from_json(doc, "bundle.json").to_json() == doc
    with pytest.raises(BundleError, match=r"mlflow_run_ids: not a field"):
        write_bundle(clean.parent / "other", {"target": {"hf": STORIES}}, mlflow_run_ids={"X": "run"})

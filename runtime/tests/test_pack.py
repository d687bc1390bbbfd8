"""Packed bundles (stage 2E's format): byte-for-byte round trip with a trained dictionary,
loading a packed bundle directly, and a corrupted packed file refused by name."""

from __future__ import annotations

import filecmp
import json
import shutil

import pytest

from kibidango import BundleError, Pipeline, load_bundle, write_bundle
from kibidango.pack import pack_bundle, unpack_bundle
from tests.conftest import STORIES, needs_stories


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    needs_stories()
    root = tmp_path_factory.mktemp("pack")
    tiers = {name: {"hf": STORIES, "vocab_size": 512} for name in ("draft", "target")}
    return write_bundle(root / "bundle", tiers, {"mode": "sd", "stop_ids": [2]}, preset="test")


def test_round_trip_is_byte_for_byte_and_reports_both_ratios(bundle, tmp_path):
    meta = pack_bundle(bundle, tmp_path / "packed", dict_size=16 * 1024, level=10)
    originals = sorted(p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file())
    assert sorted(e["path"] for e in meta["files"]) == originals
    assert 0 < meta["packed_bytes"] < meta["bytes"] and meta["bytes_without_dictionary"] > 0
    assert json.loads((tmp_path / "packed" / "pack.json").read_text())["dictionary_bytes"] <= 16 * 1024
    restored = unpack_bundle(tmp_path / "packed", tmp_path / "restored")
    for rel in originals:
        assert filecmp.cmp(bundle / rel, restored / rel, shallow=False), rel


def test_a_packed_bundle_loads_and_generates_like_the_original(bundle, tmp_path, monkeypatch):
    monkeypatch.setenv("KIBIDANGO_CACHE", str(tmp_path / "cache"))
    pack_bundle(bundle, tmp_path / "packed", dict_size=16 * 1024)
    packed = load_bundle(tmp_path / "packed")
    assert packed.root.is_relative_to(tmp_path / "cache") and packed.manifest.preset == "test"
    a = Pipeline.from_bundle(bundle).generate("Once upon a time", max_new_tokens=16)
    b = Pipeline.from_bundle(tmp_path / "packed").generate("Once upon a time", max_new_tokens=16)
    assert a.token_ids == b.token_ids


def test_corrupted_packed_file_is_refused_by_name(bundle, tmp_path, monkeypatch):
    monkeypatch.setenv("KIBIDANGO_CACHE", str(tmp_path / "cache"))
    packed = tmp_path / "packed"
    pack_bundle(bundle, packed, dict_size=16 * 1024)
    victim = packed / "files" / "tiers" / "target" / "hf" / "config.json.zst"
    good = victim.read_bytes()
    victim.write_bytes(good[:-7])
    with pytest.raises(
        BundleError, match=r"config\.json\.zst does not decompress|tiers/target/hf/config\.json unpacks"
    ):
        load_bundle(packed)
    assert not (tmp_path / "cache" / "unpacked").exists() or not any((tmp_path / "cache" / "unpacked").iterdir())
    victim.unlink()
    with pytest.raises(BundleError, match=r"packed file files/tiers/target/hf/config\.json\.zst .* is missing"):
        unpack_bundle(packed, tmp_path / "out")
    shutil.rmtree(packed)

"""Packed bundles (stage 2E's format): byte-for-byte round trip with a trained dictionary,
loading a packed bundle directly, and a corrupted packed file refused by name."""

from __future__ import annotations

import filecmp
import json
import shutil

import pytest

from kibidango import BundleError, Pipeline, load_bundle, write_bundle
from kibidango.bundle.pack import pack_bundle, unpack_bundle
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


def test_a_wrong_pin_is_refused_before_anything_is_unpacked(bundle, tmp_path, monkeypatch):
    """A wrong ``--expect-sha256`` used to be checked after the whole pack was unpacked into the
    cache (572 MiB left behind): it is checked against pack.json's bundle.json entry first."""
    monkeypatch.setenv("KIBIDANGO_CACHE", str(tmp_path / "cache"))
    packed = tmp_path / "packed"
    pack_bundle(bundle, packed, dict_size=16 * 1024)
    with pytest.raises(BundleError, match="was expected \\(pinned\\): refused"):
        load_bundle(packed, expect_sha256="0" * 64)
    cache = tmp_path / "cache" / "unpacked"
    assert not cache.exists() or not any(cache.iterdir())
    right = json.loads((packed / "pack.json").read_text())
    pin = next(e["sha256"] for e in right["files"] if e["path"] == "bundle.json")
    assert load_bundle(packed, expect_sha256=pin).digest == pin


def _repacked(packed, tmp_path, edit) -> object:
    """A copy of the pack whose pack.json ``edit`` changed."""
    copy = tmp_path / f"edited{len(list(tmp_path.iterdir()))}"
    shutil.copytree(packed, copy)
    meta = json.loads((copy / "pack.json").read_text())
    edit(meta, copy)
    (copy / "pack.json").write_text(json.dumps(meta))
    return copy


def test_a_pack_is_bounded_before_and_while_it_unpacks(bundle, tmp_path, monkeypatch):
    """A pack declaring 1 TiB is refused before anything is written; a 30 KB frame that unpacks
    to 256 MiB (declared as 1 MiB) is stopped at the size declared, never held whole; a refused
    load leaves nothing in the cache; the CLI says so in one line, no traceback."""
    import subprocess
    import sys

    import zstandard

    from kibidango.cli import main

    monkeypatch.setenv("KIBIDANGO_CACHE", str(tmp_path / "cache"))
    packed = tmp_path / "packed"
    pack_bundle(bundle, packed, dict_size=16 * 1024)

    def tebibyte(meta, _):
        meta["files"][0]["size"] = 1 << 40

    huge = _repacked(packed, tmp_path, tebibyte)
    with pytest.raises(BundleError, match=r"declare 1,099,51[0-9,]* bytes, more than the 68,719,476,736"):
        unpack_bundle(huge, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert main(["inspect", str(huge)]) == 2

    def bomb(meta, copy):
        entry = meta["files"][0]
        dictionary = zstandard.ZstdCompressionDict((copy / "dictionary.zstd").read_bytes())
        writer = zstandard.ZstdCompressor(level=3, dict_data=dictionary)
        with open(copy / entry["packed"], "wb") as fh, writer.stream_writer(fh) as z:
            for _ in range(256):
                z.write(bytes(1 << 20))
        entry["size"] = 1 << 20

    bombed = _repacked(packed, tmp_path, bomb)
    assert (bombed / json.loads((bombed / "pack.json").read_text())["files"][0]["packed"]).stat().st_size < 64_000
    probe = (
        "import resource, sys\n"
        "from kibidango import BundleError\n"
        "from kibidango.bundle.pack import unpack_bundle\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "try:\n"
        "    unpack_bundle(sys.argv[1], sys.argv[2])\n"
        "except BundleError as e:\n"
        "    print('refused', e)\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, str(bombed), str(tmp_path / "bombed-out")], capture_output=True, text=True
    )
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("refused") and "does not match its sha256" in lines[0], done.stdout + done.stderr
    assert int(lines[-1]) < 64, lines  # MiB the unpack grew by: one chunk at a time, not 256 MiB
    assert not (tmp_path / "bombed-out").exists()
    assert not any(p.name.startswith("bombed-out.tmp") for p in tmp_path.iterdir())

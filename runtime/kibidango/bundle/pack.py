"""Packed bundles (stage 2E): every file of a bundle compressed with zstd and one trained
dictionary, with the size and sha256 of every original file.

    packed/
      pack.json          schema, level, dictionary id, every file: path, size, sha256, packed path, packed size
      dictionary.zstd    the trained zstd dictionary (raw bytes, as zstd --train writes it)
      files/<path>.zst   one zstd frame per bundle file

:func:`unpack_bundle` restores the bundle byte for byte and refuses a file whose size or sha256
differs, naming it. Before it writes anything it refuses a pack.json whose paths would read or
write outside the pack or the output directory (absolute paths, ``..``, symlinks that lead out),
one that declares more bytes than :func:`max_unpacked_bytes` allows or than the disk has free,
and — given the manifest digest the user pinned — one whose ``bundle.json`` is not that one.
Each file is decompressed as a stream (hashed and written as it comes, never held whole) and
stops at the size pack.json declares; whatever a refused unpack wrote is removed.
:func:`load_bundle` (``kibidango.bundle``) unpacks a packed bundle into a cache directory first
and then verifies the bundle itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from kibidango.integrity import BundleError, contained, read_json, sha256_file

__all__ = ["PACK_SCHEMA", "max_unpacked_bytes", "pack_bundle", "unpack_bundle", "is_packed", "unpacked_cache"]

PACK_SCHEMA = 1
_SAMPLE = 16 * 1024  # bytes per dictionary training sample
_CHUNK = 1 << 20  # bytes decompressed at a time
_DEFAULT_MAX_UNPACKED = 64 << 30  # the llama31-8b preset's bundle is ~10 GB


def max_unpacked_bytes() -> int:
    """The most a pack may declare: ``$KIBIDANGO_MAX_UNPACKED_BYTES``, else 64 GiB."""
    value = os.environ.get("KIBIDANGO_MAX_UNPACKED_BYTES", "")
    if not value:
        return _DEFAULT_MAX_UNPACKED
    if not value.isdigit():
        raise BundleError(f"$KIBIDANGO_MAX_UNPACKED_BYTES: a whole number of bytes, not {value!r}")
    return int(value)


def _zstd():
    try:
        import zstandard
    except ImportError as e:
        raise BundleError("packed bundles need the zstandard package: pip install zstandard") from e
    return zstandard


def is_packed(path: str | Path) -> bool:
    return (Path(path) / "pack.json").is_file() and not (Path(path) / "bundle.json").is_file()


def _samples(files: list[Path], budget: int) -> list[bytes]:
    """Chunks of every file, spread evenly, at most ``budget`` bytes in all: zstd trains a
    dictionary on many small samples."""
    total = sum(f.stat().st_size for f in files)
    stride = max(1, total // max(budget, 1))
    out = []
    for f in files:
        with open(f, "rb") as fh:
            data = fh.read()
        for start in range(0, len(data), _SAMPLE * stride):
            out.append(data[start : start + _SAMPLE])
    return out


def pack_bundle(
    bundle_dir: str | Path,
    out_dir: str | Path,
    *,
    dict_size: int = 128 * 1024,
    level: int = 10,
    sample_budget: int = 64 * 1024 * 1024,
) -> dict[str, Any]:
    """Train a ``dict_size`` dictionary on the bundle's files, compress each at ``level`` with it,
    and write ``out_dir`` (renamed into place when complete). Returns pack.json's content, with
    ``bytes_without_dictionary`` (the same files compressed at ``level`` with no dictionary)."""
    zstd = _zstd()
    src, out = Path(bundle_dir), Path(out_dir)
    files = sorted(p for p in src.rglob("*") if p.is_file())
    if not files:
        raise BundleError(f"{src}: nothing to pack")
    try:
        dictionary = zstd.train_dictionary(dict_size, _samples(files, sample_budget), level=level)
    except zstd.ZstdError as e:
        raise BundleError(
            f"{src}: zstd could not train a {dict_size}-byte dictionary on these files ({e}); use a smaller dict_size"
        ) from e
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "files").mkdir(parents=True)
    (tmp / "dictionary.zstd").write_bytes(dictionary.as_bytes())
    with_dict = zstd.ZstdCompressor(level=level, dict_data=dictionary, write_checksum=True)
    plain = zstd.ZstdCompressor(level=level, write_checksum=True)
    entries, without = [], 0
    for f in files:
        rel = f.relative_to(src).as_posix()
        data = f.read_bytes()
        packed = tmp / "files" / (rel + ".zst")
        packed.parent.mkdir(parents=True, exist_ok=True)
        packed.write_bytes(with_dict.compress(data))
        without += len(plain.compress(data))
        entries.append(
            {
                "path": rel,
                "size": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
                "packed": packed.relative_to(tmp).as_posix(),
                "packed_size": packed.stat().st_size,
            }
        )
    meta = {
        "schema": PACK_SCHEMA,
        "level": level,
        "dictionary": "dictionary.zstd",
        "dictionary_id": dictionary.dict_id(),
        "dictionary_bytes": len(dictionary.as_bytes()),
        "files": entries,
        "bytes": sum(e["size"] for e in entries),
        "packed_bytes": sum(e["packed_size"] for e in entries),
        "bytes_without_dictionary": without,
    }
    (tmp / "pack.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return meta


def unpack_bundle(packed_dir: str | Path, out_dir: str | Path, expect_sha256: str | None = None) -> Path:
    """Restore a packed bundle into ``out_dir``: every file decompressed with the pack's
    dictionary and checked against its size and sha256 before the directory is renamed into
    place. A mismatch raises :class:`BundleError` naming the file. ``expect_sha256``: the
    manifest digest pinned (``--expect-sha256``), checked against pack.json's ``bundle.json``
    entry before anything is written."""
    zstd = _zstd()
    src, out = Path(packed_dir), Path(out_dir)
    where = src / "pack.json"
    meta = read_json(where, f"{src}: not a packed bundle (no pack.json)")
    if not isinstance(meta, dict) or meta.get("schema") != PACK_SCHEMA:
        found = meta.get("schema") if isinstance(meta, dict) else type(meta).__name__
        raise BundleError(f"{where}: pack schema {found!r}, this runtime reads {PACK_SCHEMA}")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    entries = _checked_entries(src, tmp, meta, where)  # every path checked before anything is written
    if expect_sha256:
        manifest = next((e for e, _, _ in entries if e["path"] == "bundle.json"), None)
        if manifest is None or manifest["sha256"] != expect_sha256:
            found = manifest["sha256"] if manifest else "no bundle.json"
            raise BundleError(
                f"{where}: bundle.json sha256 {found}, but {expect_sha256} was expected (pinned): refused"
            )
    _check_room(out, sum(e["size"] for e, _, _ in entries), where)
    dictionary = zstd.ZstdCompressionDict(contained(src, meta.get("dictionary"), f"{where}: dictionary").read_bytes())
    if dictionary.dict_id() != meta.get("dictionary_id"):
        raise BundleError(f"{src}: {meta['dictionary']} is not the dictionary the files were packed with")
    dctx = zstd.ZstdDecompressor(dict_data=dictionary)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for e, packed, dest in entries:
            if not packed.is_file():
                raise BundleError(f"{src}: packed file {e['packed']} (of {e['path']}) is missing")
            dest.parent.mkdir(parents=True, exist_ok=True)
            _unpack_file(zstd, dctx, packed, dest, e, src)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _unpack_file(zstd, dctx, packed: Path, dest: Path, e: dict, src: Path) -> None:
    """One packed file into ``dest``: decompressed a chunk at a time, hashed as it comes, stopped
    past the size pack.json declares."""
    digest, size = hashlib.sha256(), 0
    try:
        with open(packed, "rb") as fh, dctx.stream_reader(fh) as reader, open(dest, "wb") as out:
            while chunk := reader.read(_CHUNK):
                size += len(chunk)
                if size > e["size"]:
                    break
                digest.update(chunk)
                out.write(chunk)
    except zstd.ZstdError as err:
        raise BundleError(f"{src}: {e['packed']} does not decompress ({err}): corrupted") from err
    if size != e["size"] or digest.hexdigest() != e["sha256"]:
        raise BundleError(f"{src}: {e['path']} unpacks to content that does not match its sha256 in pack.json")


def _check_room(out: Path, declared: int, where: Path) -> None:
    """Refuse a pack that declares more than the runtime unpacks, or than the disk has free."""
    limit = max_unpacked_bytes()
    if declared > limit:
        raise BundleError(
            f"{where}: the files declare {declared:,} bytes, more than the {limit:,} this runtime unpacks "
            "(set KIBIDANGO_MAX_UNPACKED_BYTES to allow more): refused"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if declared > free:
        raise BundleError(f"{where}: the files declare {declared:,} bytes; {out.parent} has {free:,} free: refused")


def _checked_entries(src: Path, tmp: Path, meta: dict, where: Path) -> list[tuple[dict, Path, Path]]:
    """pack.json's files as (entry, packed file inside ``src``, destination inside ``tmp``)."""
    files = meta.get("files")
    if not isinstance(files, list) or not files:
        raise BundleError(f"{where}: files is not a non-empty list")
    out, seen = [], set()
    for i, e in enumerate(files):
        if (
            not isinstance(e, dict)
            or not isinstance(e.get("size"), int)
            or isinstance(e["size"], bool)
            or e["size"] < 0
            or not isinstance(e.get("sha256"), str)
        ):
            raise BundleError(f"{where}: files[{i}] needs path, packed, size and sha256")
        dest = contained(tmp, e.get("path"), f"{where}: files[{i}].path")
        packed = contained(src, e.get("packed"), f"{where}: files[{i}].packed")
        if e["path"] in seen:
            raise BundleError(f"{where}: files[{i}].path {e['path']!r} is listed twice")
        seen.add(e["path"])
        out.append((e, packed, dest))
    return out


def unpacked_cache(packed_dir: str | Path) -> Path:
    """Where a packed bundle is unpacked for use (``$KIBIDANGO_CACHE`` or ~/.cache/kibidango),
    keyed by its pack.json: unpacked once, reused while the pack is the same."""
    root = Path(os.environ.get("KIBIDANGO_CACHE", Path.home() / ".cache" / "kibidango"))
    digest = sha256_file(Path(packed_dir) / "pack.json")[:16]
    return root / "unpacked" / digest

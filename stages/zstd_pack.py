"""Stage 2E — zstd packing of the bundle: one dictionary trained on the bundle's files (the
plan: 128 KB, level 10), every file compressed with it, SHA-256 of every original file, and a
byte-for-byte round trip before anything is published.

The format is the runtime's (:mod:`kibidango.bundle.pack`): ``kibidango inspect`` and
``kibidango generate`` take the packed directory as they take a bundle, unpacking into a cache.
The stage reports the real ratios, with and without the dictionary, for the weights and for the
rest: on quantized weights zstd gains little (they are close to random bytes); the dictionary
pays on the many small JSON/tokenizer files.

Outputs: ``packed/`` (pack.json, dictionary.zstd, files/), ``pack_report.md``.
"""

from __future__ import annotations

import filecmp
import json
import tempfile
from pathlib import Path

from pydantic import Field

from core.contract import KibidangoError, StageConfig, StageResult

LIBRARIES = ("zstandard",)

_WEIGHTS = (".safetensors", ".gguf")


class Config(StageConfig):
    dict_size: int = Field(128 * 1024, gt=256, description="Bytes of the trained zstd dictionary (the plan: 128 KB).")
    level: int = Field(10, ge=1, le=22, description="zstd compression level (the plan: 10).")


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path) -> StageResult:
    from kibidango.bundle.pack import pack_bundle, unpack_bundle

    bundle = inputs["bundle"] / "bundle"
    if not (bundle / "bundle.json").is_file():
        raise KibidangoError(f"{bundle} is not a bundle (no bundle.json); wire stage X as input 'bundle'")
    packed = out_dir / "packed"
    meta = pack_bundle(bundle, packed, dict_size=cfg.dict_size, level=cfg.level)

    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:  # the round trip, byte for byte
        restored = unpack_bundle(packed, Path(tmp) / "restored")
        for e in meta["files"]:
            if not filecmp.cmp(bundle / e["path"], restored / e["path"], shallow=False):
                raise KibidangoError(f"{e['path']} does not survive the zstd round trip byte for byte")

    weights = [e for e in meta["files"] if e["path"].endswith(_WEIGHTS)]
    other = [e for e in meta["files"] if not e["path"].endswith(_WEIGHTS)]
    metrics = {
        "files": float(len(meta["files"])),
        "bytes": float(meta["bytes"]),
        "packed_bytes": float(meta["packed_bytes"]),
        "bytes_without_dictionary": float(meta["bytes_without_dictionary"]),
        "ratio": meta["bytes"] / meta["packed_bytes"],
        "ratio_without_dictionary": meta["bytes"] / meta["bytes_without_dictionary"],
        "weights_ratio": sum(e["size"] for e in weights) / max(sum(e["packed_size"] for e in weights), 1),
        "other_ratio": sum(e["size"] for e in other) / max(sum(e["packed_size"] for e in other), 1),
        "dictionary_bytes": float(meta["dictionary_bytes"]),
    }
    report = [
        "# Stage 2E — zstd packing",
        "",
        f"zstd level {cfg.level}, trained dictionary {meta['dictionary_bytes']:,} bytes (asked: {cfg.dict_size:,}).",
        "",
        "| | bytes | packed | ratio |",
        "|---|---:|---:|---:|",
        f"| whole bundle, with the dictionary | {meta['bytes']:,} | {meta['packed_bytes']:,} | "
        f"{metrics['ratio']:.3f} |",
        f"| whole bundle, no dictionary | {meta['bytes']:,} | {meta['bytes_without_dictionary']:,} | "
        f"{metrics['ratio_without_dictionary']:.3f} |",
        f"| weights (.safetensors, .gguf) | {sum(e['size'] for e in weights):,} | "
        f"{sum(e['packed_size'] for e in weights):,} | {metrics['weights_ratio']:.3f} |",
        f"| everything else | {sum(e['size'] for e in other):,} | {sum(e['packed_size'] for e in other):,} | "
        f"{metrics['other_ratio']:.3f} |",
        "",
        f"Round trip: all {len(meta['files'])} files restored byte for byte and match their SHA-256.",
    ]
    (out_dir / "pack_report.md").write_text("\n".join(report) + "\n")
    (out_dir / "pack.json").write_text(json.dumps(metrics, indent=2))
    summary = (
        f"{meta['bytes'] / 1e6:.2f} MB -> {meta['packed_bytes'] / 1e6:.2f} MB with the dictionary "
        f"(x{metrics['ratio']:.3f}; without it x{metrics['ratio_without_dictionary']:.3f}; weights "
        f"x{metrics['weights_ratio']:.3f}); "
        f"round trip verified"
    )
    return StageResult(metrics, ["pack_report.md", "pack.json"], summary)

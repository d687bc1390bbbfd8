"""The bundle: ``bundle.json`` plus the files it lists (ARCHITECTURE.md §4).

    bundle/
      bundle.json                      schema, provenance, every file with size + sha256,
                                       tier table, runtime defaults
      tiers/<tier>/hf/                 transformers-loadable weights and tokenizer
      tiers/<tier>/gguf/<name>.gguf    llama.cpp-loadable weights

:func:`load_bundle` verifies every listed file before anything is loaded and refuses a bundle
whose files are missing, truncated or altered, naming the file. :func:`write_bundle` makes one
(the pipeline's export stage and the tests use it).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

__all__ = ["Bundle", "BundleError", "Tier", "TIER_ORDER", "load_bundle", "write_bundle"]

SCHEMA_VERSION = 1
TIER_ORDER = ("draft", "qualifier", "target")
_TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class BundleError(Exception):
    """A bundle that cannot be used as it is; the message names the file or tier at fault."""


@dataclass(frozen=True)
class Tier:
    name: str
    hf: Path | None
    gguf: Path | None
    info: dict[str, Any]


@dataclass
class Bundle:
    root: Path
    meta: dict[str, Any]
    tiers: dict[str, Tier]
    defaults: dict[str, Any] = field(default_factory=dict)

    def tier(self, name: str, backend: str = "torch") -> Tier:
        if name not in self.tiers:
            have = ", ".join(self.tiers) or "none"
            raise BundleError(f"{self.root}: bundle has no '{name}' tier (it has: {have})")
        tier = self.tiers[name]
        if backend == "torch" and tier.hf is None:
            raise BundleError(f"{self.root}: tier '{name}' has no HF weights (tiers/{name}/hf) for the torch backend")
        if backend == "llamacpp" and tier.gguf is None:
            raise BundleError(f"{self.root}: tier '{name}' has no GGUF file (tiers/{name}/gguf) for the llamacpp backend")
        return tier

    @property
    def tokenizer_dir(self) -> Path:
        """Every tier shares one tokenizer (checked at load); this is the target's copy."""
        for name in ("target", *TIER_ORDER):
            if name in self.tiers and self.tiers[name].hf is not None:
                return self.tiers[name].hf
        raise BundleError(f"{self.root}: no tier carries a tokenizer (tiers/<tier>/hf/tokenizer.*)")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def read_json(path: Path, missing: str) -> Any:
    """A JSON file the runtime reads (bundle.json, pack.json, adapter.json): ``missing`` is the
    message when it is absent; invalid JSON names the file."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as e:
        raise BundleError(missing) from e
    except json.JSONDecodeError as e:
        raise BundleError(f"{path}: not valid JSON: {e}") from e


def load_bundle(path: str | Path, verify: bool = True) -> Bundle:
    """Read ``bundle.json`` and (by default) check every listed file's size and sha256. A packed
    bundle (stage 2E: ``pack.json``, zstd files) is unpacked into a cache directory first."""
    root = Path(path)
    from kibidango.pack import is_packed, unpack_bundle, unpacked_cache

    if is_packed(root):
        cache = unpacked_cache(root)
        if not (cache / "bundle.json").is_file():
            unpack_bundle(root, cache)
        root = cache
    manifest = root / "bundle.json"
    meta = read_json(manifest, f"{root}: not a bundle (no bundle.json)")
    if meta.get("schema_version") != SCHEMA_VERSION:
        raise BundleError(f"{manifest}: schema_version {meta.get('schema_version')!r}, this runtime reads {SCHEMA_VERSION}")
    if verify:
        for entry in meta.get("files", []):
            p = root / entry["path"]
            if not p.is_file():
                raise BundleError(f"{root}: file {entry['path']} is missing")
            if p.stat().st_size != entry["size"]:
                raise BundleError(
                    f"{root}: file {entry['path']} has {p.stat().st_size} bytes, bundle.json says {entry['size']} (truncated or replaced)"
                )
            if _sha256(p) != entry["sha256"]:
                raise BundleError(f"{root}: file {entry['path']} does not match its sha256 in bundle.json (tampered or corrupted)")
    tiers = {}
    for name, spec in meta.get("tiers", {}).items():
        hf = root / spec["hf"] if spec.get("hf") else None
        gguf = root / spec["gguf"] if spec.get("gguf") else None
        tiers[name] = Tier(name, hf, gguf, {k: v for k, v in spec.items() if k not in ("hf", "gguf")})
    if not tiers:
        raise BundleError(f"{manifest}: no tiers")
    bundle = Bundle(root, meta, tiers, meta.get("runtime_defaults", {}))
    _check_shared_tokenizer(bundle)
    return bundle


def _tokenizer_digest(hf_dir: Path) -> str:
    h = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        if (hf_dir / name).is_file():
            h.update(name.encode() + _sha256(hf_dir / name).encode())
    return h.hexdigest()


def _check_shared_tokenizer(bundle: Bundle) -> None:
    digests = {name: _tokenizer_digest(t.hf) for name, t in bundle.tiers.items() if t.hf is not None}
    if len(set(digests.values())) > 1:
        detail = ", ".join(f"{n}: {d[:12]}" for n, d in digests.items())
        raise BundleError(f"{bundle.root}: tiers do not share one tokenizer ({detail}); speculative decoding needs identical vocabularies")
    vocab = {n: t.info.get("vocab_size") for n, t in bundle.tiers.items() if t.info.get("vocab_size")}
    if len(set(vocab.values())) > 1:
        raise BundleError(f"{bundle.root}: tiers have different vocabulary sizes: {vocab}")


def write_bundle(
    root: str | Path,
    tiers: dict[str, dict[str, Any]],
    runtime_defaults: dict[str, Any] | None = None,
    finalize: Callable[[Path], dict[str, Any]] | None = None,
    **meta: Any,
) -> Path:
    """Assemble a bundle at ``root``. ``tiers`` maps a tier name to ``{"hf": dir, "gguf": file,
    **info}`` (either weight form may be absent); files are copied into the layout, hashed and
    listed. Extra keyword arguments (preset, pipeline git sha, cache keys, MLflow run ids, ...)
    go into bundle.json as they are. ``finalize(tmp_dir)`` may add files (adapters, the card)
    before anything is hashed and returns more bundle.json fields. Written to a temporary
    directory and renamed into place."""
    root = Path(root)
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tier_table: dict[str, dict[str, Any]] = {}
    for name, spec in tiers.items():
        entry = {k: v for k, v in spec.items() if k not in ("hf", "gguf")}
        if spec.get("hf"):
            dest = tmp / "tiers" / name / "hf"
            shutil.copytree(spec["hf"], dest)
            entry["hf"] = dest.relative_to(tmp).as_posix()
        if spec.get("gguf"):
            src = Path(spec["gguf"])
            dest = tmp / "tiers" / name / "gguf" / src.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest)
            entry["gguf"] = dest.relative_to(tmp).as_posix()
        tier_table[name] = entry
    if finalize is not None:
        meta.update(finalize(tmp))
    files = [
        {"path": p.relative_to(tmp).as_posix(), "size": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(tmp.rglob("*"))
        if p.is_file()
    ]
    body = {
        "schema_version": SCHEMA_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **meta,
        "tiers": tier_table,
        "runtime_defaults": runtime_defaults or {},
        "files": files,
    }
    (tmp / "bundle.json").write_text(json.dumps(body, indent=2, sort_keys=True))
    if root.exists():
        shutil.rmtree(root)
    tmp.rename(root)
    return root

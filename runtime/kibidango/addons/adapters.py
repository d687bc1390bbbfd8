"""Domain adapters (stages 3-5), loaded lazily: nothing is read until a request asks for a
domain, and then only that domain's files, after checking their sha256 against the manifest.

An adapter directory holds ``adapter.json`` (written by the pipeline)::

    {"schema": 1, "domain": "code", "base_tier": "target",
     "formats": {"peft": [{"path": "adapter/adapter_config.json", "size": ..., "sha256": ...}, ...],
                 "gguf": [{"path": "adapter.gguf", ...}]}, "metrics": {...}}

``peft`` adapters apply to a torch model (needs the ``peft`` package); ``gguf`` adapters are
passed to llama.cpp (``Llama(lora_path=...)``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kibidango.integrity import BundleError, contained, read_json, sha256_file

__all__ = ["Adapter", "AdapterSet", "LoadedAdapters"]


@dataclass
class Adapter:
    root: Path
    domain: str
    base_tier: str
    formats: dict[str, list[dict[str, Any]]]
    metrics: dict[str, float] = field(default_factory=dict)
    listed: Callable[[Path], bool] | None = None
    """For an adapter inside a bundle: whether bundle.json lists (and so hashed) a file."""

    @classmethod
    def from_dir(cls, root: str | Path, listed: Callable[[Path], bool] | None = None) -> Adapter:
        root = Path(root)
        spec = read_json(root / "adapter.json", f"{root}: no adapter.json")
        return cls(
            root, spec["domain"], spec.get("base_tier", "target"), spec["formats"], spec.get("metrics", {}), listed
        )

    def files(self, fmt: str) -> list[Path]:
        """The adapter's files in ``fmt`` ('peft' or 'gguf'), each checked against its sha256."""
        if fmt not in self.formats:
            raise BundleError(
                f"adapter {self.domain!r} ({self.root}) has no {fmt} files; it has {', '.join(self.formats)}"
            )
        out = []
        for entry in self.formats[fmt]:
            path = contained(self.root, entry.get("path"), f"{self.root / 'adapter.json'}: {fmt} file")
            if not path.is_file():
                raise BundleError(f"adapter {self.domain!r}: file {entry['path']} is missing")
            if self.listed is not None and not self.listed(path):
                raise BundleError(
                    f"adapter {self.domain!r}: file {entry['path']} is not listed in bundle.json: refused"
                )
            if path.stat().st_size != entry["size"] or sha256_file(path) != entry["sha256"]:
                raise BundleError(
                    f"adapter {self.domain!r}: file {entry['path']} does not match its sha256 (tampered or corrupted)"
                )
            out.append(path)
        return out

    def apply_peft(self, model):
        """``model`` (a transformers model of the base tier) with this adapter merged in."""
        try:
            from peft import PeftModel
        except ImportError as e:
            raise BundleError("peft adapters need the `peft` package (pip install peft)") from e
        config = next(p for p in self.files("peft") if p.name == "adapter_config.json")
        return PeftModel.from_pretrained(model, str(config.parent)).merge_and_unload()

    def gguf_path(self) -> Path:
        return self.files("gguf")[0]

    def peft_dir(self) -> Path:
        """The directory of the peft files (each checked against its sha256)."""
        return next(p for p in self.files("peft") if p.name == "adapter_config.json").parent


class AdapterSet:
    """Every adapter under a directory (``<dir>/<name>/adapter.json``), read on first use."""

    def __init__(self, root: str | Path, listed: Callable[[Path], bool] | None = None):
        self.root = Path(root)
        self.listed = listed  # in a bundle: only adapters whose files bundle.json lists
        self._index: dict[str, Path] | None = None
        self._loaded: dict[str, Adapter] = {}

    @classmethod
    def from_dirs(cls, dirs: list[str | Path]) -> AdapterSet:
        """Adapters that live in separate directories, each with its ``adapter.json`` (the
        pipeline's stage outputs), keyed by their domain."""
        self = cls(Path("."))
        self._index = {}
        for d in dirs:
            spec = read_json(Path(d) / "adapter.json", f"{d}: no adapter.json")
            self._index[spec["domain"]] = Path(d)
        return self

    @property
    def domains(self) -> list[str]:
        return sorted(self._scan())

    def _scan(self) -> dict[str, Path]:
        if self._index is None:  # built whole, then published: a concurrent first call never sees half of it
            index = {}
            for manifest in sorted(self.root.glob("*/adapter.json")):
                if self.listed is None or self.listed(manifest):
                    index[json.loads(manifest.read_text())["domain"]] = manifest.parent
            self._index = index
        return self._index

    def get(self, domain: str) -> Adapter:
        if domain not in self._loaded:
            index = self._scan()
            if domain not in index:
                raise BundleError(
                    f"no adapter for domain {domain!r} under {self.root}; have: {', '.join(sorted(index)) or 'none'}"
                )
            self._loaded[domain] = Adapter.from_dir(index[domain], self.listed)
        return self._loaded[domain]


class LoadedAdapters:
    """The adapters applied to one model (a bundle's ``base_tier``, the target), least recently
    used first out: ``use(domain)`` makes ``domain``'s adapter the active one, loading it on first
    use (files checked against their sha256) and unloading the least recently used one when more
    than ``size`` would be loaded; ``use(None)`` runs the base weights. ``keep`` (the bundle's
    default adapter) is never evicted and not counted in ``size``. ``loads`` counts loads (an
    adapter evicted and asked for again is loaded again). Not thread-safe: the caller holds the
    model for the whole generation."""

    def __init__(self, model, adapters: AdapterSet, size: int = 2, keep: str | None = None):
        if size < 1:
            raise ValueError("the adapter cache holds at least one adapter")
        self.model = model
        self.adapters = adapters
        self.size = size
        self.keep = keep
        self.loaded: dict[str, Adapter] = {}  # insertion order = recency, oldest first
        self.active: str | None = None
        self.loads = 0
        self.evictions = 0

    def fits(self, domains) -> bool:
        """Whether the adapters of ``domains`` (None: the base weights) can all be loaded at once."""
        return len(set(domains) - {None, self.keep}) <= self.size

    def use(self, domain: str | None) -> None:
        if domain is not None and domain not in self.loaded:
            adapter = self.adapters.get(domain)
            while domain != self.keep and sum(d != self.keep for d in self.loaded) >= self.size:
                oldest = next(d for d in self.loaded if d != self.keep)
                if self.active == oldest:
                    self.model.set_lora(None)
                    self.active = None
                self.model.unload_lora(oldest)
                del self.loaded[oldest]
                self.evictions += 1
            self.model.load_lora(domain, adapter)
            self.loaded[domain] = adapter
            self.loads += 1
        elif domain is not None:
            self.loaded[domain] = self.loaded.pop(domain)  # most recently used
        if domain != self.active:
            self.model.set_lora(domain)
            self.active = domain

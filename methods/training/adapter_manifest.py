"""``adapter.json``: the manifest the runtime reads to lazy-load a LoRA adapter
(:mod:`kibidango.addons.adapters`), written by the stages that train adapters (3-5, 2F)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from core.hashing import file_sha256

__all__ = ["ships", "write_adapter_manifest"]


def write_adapter_manifest(out_dir: Path, formats: dict[str, list[str]], **fields: Any) -> dict[str, Any]:
    """Write ``out_dir/adapter.json``: ``fields`` (domain, base_tier, base_model, lora, metrics)
    and, per format ('peft', 'gguf'), every file (relative to ``out_dir``) with size and sha256."""
    manifest = {
        "schema": 1,
        **fields,
        "formats": {
            fmt: [{"path": f, "size": (out_dir / f).stat().st_size, "sha256": file_sha256(out_dir / f)} for f in files]
            for fmt, files in formats.items()
        },
    }
    (out_dir / "adapter.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def ships(adapter_dir: Path) -> bool:
    """Whether the adapter in ``adapter_dir`` ships: its stage's check found it better than the
    weights it modifies on its domain's held-out tasks (``ships``), or it was not checked (no key)."""
    manifest = json.loads((Path(adapter_dir) / "adapter.json").read_text())
    return manifest.get("ships") is not False

"""Measurements of checkpoints taken from the files themselves: sparsity of the saved tensors
(never the recipe's claim) and bytes on disk."""

from __future__ import annotations

import re
from pathlib import Path

from core.contract import KibidangoError

__all__ = ["PRUNABLE", "weight_bytes", "weight_sparsity"]

PRUNABLE = re.compile(r"\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")
"""The decoder layers' linear weights: what the pruning recipes target (embeddings and the head
are left dense)."""

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")


def weight_bytes(path: Path) -> int:
    """Bytes of the weight files of a checkpoint directory (or of one weight file)."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))


def weight_sparsity(model_dir: Path) -> dict[str, float]:
    """Share of exact zeros in the saved decoder-layer linear weights, read from the safetensors
    files: overall, the least and most sparse tensor, and the share of groups of 4 consecutive
    input weights with at least 2 zeros (1.0 for a valid 2:4 pattern)."""
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise KibidangoError(f"{model_dir}: no .safetensors files to measure sparsity on")
    zeros = total = groups = groups_24 = 0
    per_tensor: list[float] = []
    for f in files:
        for name, t in load_file(str(f)).items():
            if name.endswith(("_packed", "bitmask", "compressed")):
                raise KibidangoError(
                    f"{f}: tensor {name} is stored compressed; save the pruned model dense to measure it"
                )
            if not PRUNABLE.search(name):
                continue
            z = int((t == 0).sum())
            zeros, total = zeros + z, total + t.numel()
            per_tensor.append(z / t.numel())
            if t.shape[-1] % 4 == 0:
                g = (t.reshape(-1, 4) == 0).sum(-1)
                groups, groups_24 = groups + g.numel(), groups_24 + int((g >= 2).sum())
    if not total:
        raise KibidangoError(f"{model_dir}: no decoder-layer linear weights (*.layers.N.*_proj.weight) found")
    return {
        "sparsity": zeros / total,
        "sparsity_min_tensor": min(per_tensor),
        "sparsity_max_tensor": max(per_tensor),
        "share_2of4_groups": groups_24 / groups if groups else 0.0,
        "pruned_tensors": float(len(per_tensor)),
    }

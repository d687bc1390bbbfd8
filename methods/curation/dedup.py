"""Exact and near-duplicate removal.

Exact: sha256 of the normalised text (case, punctuation and whitespace folded).
Near: datasketch MinHash signatures of word or character shingles, indexed in a MinHashLSH at a
Jaccard threshold. Rows are visited in order (sources in recipe order, then file order); a row
is kept unless it matches a row kept before it, so every cluster keeps its first member and the
result does not depend on chance. LSH candidates are confirmed with the estimated Jaccard
similarity, which removes the banding's false candidates.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from datasketch import MinHash, MinHashLSH
from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "DedupConfig",
    "Duplicate",
    "digest",
    "exact_duplicates",
    "find_duplicates",
    "first_kept_wins",
    "lsh_index",
    "normalize_for_dedup",
]


class DedupConfig(BaseModel):
    """Duplicate removal."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    exact: bool = Field(True, description="Drop rows whose normalised text equals an earlier row's.")
    near: bool = Field(True, description="Drop near-duplicates with MinHash LSH.")
    shingle: Literal["word", "char"] = Field("word", description="Shingle words or characters.")
    shingle_size: int = Field(2, ge=1, le=16, description="Words (or characters) per shingle.")
    num_perm: int = Field(128, ge=16, le=1024, description="MinHash permutations (signature length).")
    threshold: float = Field(
        0.5, gt=0, lt=1, description="Jaccard similarity at or above which two rows are near-duplicates."
    )
    seed: int = Field(1, description="MinHash permutation seed.")


@dataclass(frozen=True)
class Duplicate:
    index: int
    """Position of the dropped row in the input sequence."""
    kept: int
    """Position of the earlier row it duplicates."""
    reason: str
    """`exact_duplicate` or `near_duplicate`."""
    similarity: float


_PUNCT = re.compile(r"[^\w\s]", re.UNICODE)


def normalize_for_dedup(text: str) -> str:
    return " ".join(_PUNCT.sub(" ", text.lower()).split())


def _shingles(text: str, kind: str, n: int) -> list[bytes]:
    units = text.split() if kind == "word" else list(text)
    sep = " " if kind == "word" else ""
    if len(units) <= n:
        return [text.encode()]
    return list({sep.join(units[i : i + n]).encode() for i in range(len(units) - n + 1)})


def digest(normalized: str) -> bytes:
    return hashlib.sha256(normalized.encode()).digest()


def exact_duplicates(digests: Iterable[bytes]) -> list[Duplicate]:
    """Rows whose digest (:func:`digest` of the normalised text) an earlier row has."""
    first: dict[bytes, int] = {}
    duplicates = []
    for i, h in enumerate(digests):
        if h in first:
            duplicates.append(Duplicate(i, first[h], "exact_duplicate", 1.0))
        else:
            first[h] = i
    return duplicates


def find_duplicates(
    texts: Sequence[str], cfg: DedupConfig, progress: Callable[[int], None] | None = None, cluster=None
) -> list[Duplicate]:
    """Duplicates among ``texts``, each pointing at the earlier kept row it matches. ``cluster``
    (:class:`methods.curation.distributed.Cluster`): the same result computed on a Dask cluster
    with the LSH index in Redis."""
    if cluster is not None:
        return cluster.duplicates(texts, cfg, progress)
    normalized = [normalize_for_dedup(t) for t in texts]
    duplicates = exact_duplicates(map(digest, normalized)) if cfg.exact else []
    dropped = {d.index for d in duplicates}
    if cfg.near:
        todo = [i for i in range(len(texts)) if i not in dropped]
        signatures = MinHash.bulk(
            [_shingles(normalized[i], cfg.shingle, cfg.shingle_size) for i in todo],
            num_perm=cfg.num_perm,
            seed=cfg.seed,
        )
        duplicates += first_kept_wins(todo, signatures, lsh_index(cfg), cfg.threshold, progress)
    return sorted(duplicates, key=lambda d: d.index)


def lsh_index(cfg: DedupConfig, storage_config: dict | None = None) -> MinHashLSH:
    """An empty LSH index with stage 0's banding (in memory, or in ``storage_config``'s store).
    Candidates are confirmed with the estimated Jaccard, so a false LSH candidate costs one
    comparison while a missed one is a duplicate kept: the banding is weighted towards few false
    negatives (128 perms at 0.5: b=32, r=4 instead of b=25, r=5; a pair at Jaccard 0.7 is missed
    0.02% of the time instead of 1%)."""
    return MinHashLSH(threshold=cfg.threshold, num_perm=cfg.num_perm, weights=(0.1, 0.9), storage_config=storage_config)


def first_kept_wins(
    rows: Sequence[int], signatures: Iterable, index, threshold: float, progress: Callable[[int], None] | None = None
) -> list[Duplicate]:
    """Near duplicates in input order: a row is dropped as a duplicate of its most similar
    earlier **kept** row (LSH candidates confirmed at ``threshold`` by the estimated Jaccard),
    else kept and indexed. ``index``: an empty LSH index with ``query`` and ``insert`` (datasketch's
    ``MinHashLSH``, or a peer's) of the signatures' kind."""
    duplicates = []
    kept: dict[int, Any] = {}
    for n, (i, sig) in enumerate(zip(rows, signatures)):
        match = max(((sig.jaccard(kept[c]), c) for c in index.query(sig)), default=None)
        if match is not None and match[0] >= threshold:
            duplicates.append(Duplicate(i, match[1], "near_duplicate", match[0]))
        else:
            index.insert(i, sig)
            kept[i] = sig
        if progress and (n + 1) % 2000 == 0:
            progress(n + 1)
    return duplicates
